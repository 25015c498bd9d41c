"""Save on preemption: SIGTERM or SIGUSR1 on any rank (or the launcher going away) makes every rank finish the
step it is in, save a checkpoint and exit with ``PREEMPTED_EXIT_CODE``; a second signal ends the rank at once.
How the ranks agree, and the grace: Note [Save on preemption] in docs/design/faults.md.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Callable

__all__ = ["PREEMPTED_EXIT_CODE", "REPEAT_WINDOW_S", "Preemption", "stop_reason"]

PREEMPTED_EXIT_CODE = 75
"""Exit status of a rank that saved and stopped on request (sysexits' EX_TEMPFAIL: run it again, ``--resume
auto``)."""
REPEAT_WINDOW_S = 2.0
"""A signal within this long of the first is the same request relayed (the scheduler signals every process of
the job, and the launcher passes its own signal on to the ranks), not a second one."""
_CODES = {signal.SIGTERM: 1.0, signal.SIGUSR1: 2.0}
_LAUNCHER_GONE = 3.0
_WHY = {1.0: "SIGTERM", 2.0: "SIGUSR1", 3.0: "launcher gone"}


def stop_reason(flags: list[float]) -> str:
    """The stop request of the job, from every rank's ``Preemption.flag()`` (index = rank): e.g. "SIGTERM on rank 1"
    (pure)."""
    by_why: dict[str, list[int]] = {}
    for rank, f in enumerate(flags):
        if f:
            by_why.setdefault(_WHY.get(f, "a stop request"), []).append(rank)
    parts = []
    for why, ranks in by_why.items():
        shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        parts.append(f"{why} on rank{'s' if len(ranks) > 1 else ''} {shown}")
    return "; ".join(parts)


class Preemption:
    """One rank's stop request. ``request`` comes from a signal (through the watchdog, or ``SignalRelay`` when there
    is none) or from the watchdog when the launcher is gone; the trainer reads ``flag()`` into the step's all-gather,
    so every rank sees every request at the same step end, saves, then calls ``saved``. ``say(line)`` tells what
    the rank will do; ``end(line, code)`` ends it: for a second signal, when ``grace_s`` (0: no limit) passes before
    the checkpoint is complete, or for a signal after it."""

    def __init__(self, *, grace_s: float, end: Callable[[str, int], None], say: Callable[[str], None]) -> None:
        self.grace_s = float(grace_s)
        self._end, self._say = end, say
        self._lock = threading.Lock()
        self._flag = 0.0
        self._first: float | None = None
        self._why = ""
        self._code = 128 + int(signal.SIGTERM)
        """Exit status if the grace runs out: the first signal's (128 + its number)."""
        self._done = threading.Event()
        self._timer: threading.Timer | None = None

    def flag(self) -> float:
        """0 with no request, else a code of what asked (``stop_reason`` reads it)."""
        return self._flag

    def request_signal(self, signum: int) -> None:
        """A SIGTERM or SIGUSR1: the first is taken (the rank says so); one relayed within ``REPEAT_WINDOW_S`` is
        ignored; a later one, or any after the checkpoint is complete, ends the rank now."""
        sig = signal.Signals(signum)
        name = sig.name
        with self._lock:
            now = time.monotonic()
            if self._done.is_set():
                repeat = False
            elif self._first is None:
                self._code = 128 + int(sig)
                self._take(_CODES.get(sig, 1.0), name, now)
                return
            else:
                repeat = now - self._first < REPEAT_WINDOW_S
        if repeat:
            return
        if self._done.is_set():
            self._end(f"{name} after the checkpoint was saved", PREEMPTED_EXIT_CODE)
        else:
            self._end(f"a second signal ({name}) {time.monotonic() - self._first:.1f} s after {self._why}: "
                      "stopping without a checkpoint", 128 + int(sig))

    def request_launcher_gone(self, what: str) -> None:
        """The launcher of this rank is gone: nothing would end the rank with the job, so it saves and stops."""
        with self._lock:
            if self._first is None:
                self._take(_LAUNCHER_GONE, what, time.monotonic())

    def _take(self, code: float, why: str, now: float) -> None:
        self._flag, self._first, self._why = code, now, why
        limit = f" within {self.grace_s:g} s" if self.grace_s > 0 else ""
        self._say(f"{why}: finishing this step, then saving a checkpoint{limit} and exiting (exit code "
                  f"{PREEMPTED_EXIT_CODE}); a second signal ends the rank at once")
        if self.grace_s > 0:
            self._timer = threading.Timer(self.grace_s, self._expired)
            self._timer.daemon = True
            self._timer.start()

    def _expired(self) -> None:
        if not self._done.is_set():
            self._end(f"the checkpoint was not complete {self.grace_s:g} s after {self._why} (--preempt_grace_s): "
                      "stopping without it", self._code)

    @property
    def why(self) -> str:
        return self._why

    def saved(self) -> None:
        """The checkpoint is complete on every rank: the grace timer stops; a further signal ends the rank at once."""
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()
