"""SIGINT, SIGTERM and SIGUSR1 delivered to a callback even while the main thread is blocked in a collective, so
that a rank ends with one line instead of a traceback per thread: Note [Signals reach a blocked rank] in
docs/design/faults.md.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any, Callable

__all__ = ["CTRL_C_GRACE_S", "SIGNAL_EXIT", "SignalRelay"]

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGUSR1: 138}
"""Exit status of a rank ended by each signal (the shell's 128 + signal number)."""
CTRL_C_GRACE_S = 0.5
"""Ctrl-C reaches every process of the job at once and the launcher answers it with SIGTERM: a SIGINT that
arrives within this grace after a SIGTERM wins, so the rank's line says what the user did."""
_SIGINT, _SIGTERM, _SIGUSR1 = int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGUSR1)
_STOP = b"\0"
"""Written to the wakeup pipe by ``restore``: the reader thread closes the pipe and returns."""


class SignalRelay:
    """Hands SIGINT, SIGTERM and SIGUSR1 of this process to ``on_signal(signum)`` from a thread of its own (a blocked
    main thread never runs a Python handler), and from the main thread's handler if that runs first. ``install`` from
    the main thread; ``restore`` puts back the previous handlers and wakeup fd."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._pipe: tuple[int, int] | None = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1

    def install(self) -> threading.Thread | None:
        """The started reader thread, or None off the main thread (only it may install handlers: the caller keeps
        Python's defaults)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_handlers = {s: signal.signal(s, self._on_signal_main) for s in SIGNAL_EXIT}
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        t = threading.Thread(target=self._read, name="ds_wallfacer-watchdog-signals", daemon=True)
        t.start()
        return t

    def restore(self) -> None:
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        os.write(self._pipe[1], _STOP)  # wakes the reader, which then closes the pipe

    def _read(self) -> None:
        assert self._pipe is not None
        r, w = self._pipe
        while True:
            data = os.read(r, 64)
            if _SIGTERM in data and _SIGINT not in data and select.select([r], [], [], CTRL_C_GRACE_S)[0]:
                data += os.read(r, 64)
            forward = data.replace(_STOP, b"")
            if self._old_wakeup >= 0 and forward:  # whoever had the wakeup fd before still gets its bytes
                try:
                    os.write(self._old_wakeup, forward)
                except OSError:
                    pass
            for signum in (_SIGINT, _SIGTERM, _SIGUSR1):
                if signum in data:
                    self._on_signal(signum)
            if _STOP in data:
                os.close(r)
                os.close(w)
                return

    def _on_signal_main(self, signum: int, frame: Any) -> None:
        # the reader thread normally acts first; this runs only if the main thread gets to Python before it
        if signum == _SIGTERM:
            time.sleep(CTRL_C_GRACE_S)
        self._on_signal(signum)
