"""A rank that dies, stalls or is interrupted ends the whole job within seconds, with one line naming it.

    watchdog = Watchdog(timeout_s=30).start()     # after ``initialize``; every rank
    ...train...
    watchdog.stop()

How: Note [Watchdog: heartbeats from a thread, over the rendezvous store] in docs/design/faults.md. Signals reach it
through ``signals.SignalRelay``.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..integration.ds_runtime import THREAD_PREFIX
from .signals import SIGNAL_EXIT, SignalRelay

__all__ = ["FAULT_EXIT_CODE", "RankInfo", "Watchdog", "launchers", "say_as_rank", "start_watchdog"]

FAULT_EXIT_CODE = 3
"""Exit status of a rank that the watchdog ends because another rank died or stalled."""
_PREFIX = "ds_wallfacer/watchdog"
_DONE, _FAILED = "done", "failed"
_COMM_ERRORS = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer")
"""Text of the errors a collective raises when a peer vanishes."""


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs, as it reported itself at start-up."""

    rank: int
    host: str
    local_rank: int
    pid: int
    started: float
    """The process's start time (``psutil``), so that a reused pid is not taken for the rank."""

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, local rank {self.local_rank}, pid {self.pid})"


def _process_alive(info: RankInfo) -> bool:
    return _alive(info.pid, info.started)


def _alive(pid: int, started: float) -> bool:
    import psutil  # a DeepSpeed dependency

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def launchers() -> list[tuple[int, float, str]]:
    """(pid, start time, name) of the processes whose end orphans this rank: its parent and, under the deepspeed
    launcher, the ``deepspeed`` runner above its ``launch.py``. The runner forwards no SIGINT to ``launch.py``
    (only its multi-node pdsh path does), so ``kill -INT <runner>`` would otherwise leave the job training."""
    import psutil

    parent = psutil.Process().parent()
    if parent is None:
        return []
    out = [(parent.pid, parent.create_time(), "the process that launched this rank")]
    if "deepspeed.launcher.launch" in " ".join(parent.cmdline()):
        runner = parent.parent()
        if runner is not None and any(Path(arg).name == "deepspeed" for arg in runner.cmdline()[:2]):
            out.append((runner.pid, runner.create_time(), "the deepspeed runner of this job"))
    return out


def _store_host() -> str:
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    who = "the torchrun agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    return f"the rendezvous store at {addr}:{port} (served by {who})"


class Watchdog:
    """Heartbeat and judge threads of one rank, and its signals (see the note). ``start()`` on every rank after
    torch.distributed is initialised; ``stop()`` at the end of training (also ``with Watchdog(...):``)."""

    def __init__(self, *, timeout_s: float = 30.0, interval_s: float = 2.0, max_watched: int = 64,
                 handle_signals: bool = True, preemption: Any = None,
                 launched_by: list[tuple[int, float, str]] | None = None) -> None:
        if not timeout_s > 0 or not 0 < interval_s < timeout_s:
            raise ValueError(f"watchdog timeout_s = {timeout_s} and interval_s = {interval_s}: both must be positive"
                             " and the interval shorter than the timeout")
        self.timeout_s, self.interval_s, self.handle_signals = float(timeout_s), float(interval_s), handle_signals
        self.preemption = preemption
        """A ``preempt.Preemption``, or None: SIGTERM, SIGUSR1 and a launcher gone then ask it to save and stop,
        unless a peer on this host is gone (then the launcher is ending the job: nothing to save with)."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # each rank watches up to max_watched successors (all peers in jobs of up to max_watched + 1 ranks), so the
        # store answers O(world * max_watched) reads per interval, not O(world^2); posted verdicts reach everyone
        n = min(self.world - 1, max_watched)
        self.watched = [(self.rank + i) % self.world for i in range(1, n + 1)]
        # rank 0 serves the store under env://: its process is checked by everyone on its host
        self._pid_checked = sorted(set(self.watched) | ({0} - {self.rank}))
        self.me = RankInfo(self.rank, socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")), os.getpid(),
                           _own_start_time())
        self._store: Any = None
        self._infos: dict[int, RankInfo] = {}
        self._state: dict[int, str] = {}
        """Last value read per watched peer: a counter, "done" or "failed"."""
        self._changed: dict[int, float] = {}
        """Monotonic time at which each watched peer's counter was last seen to change."""
        self._posted: dict | None = None
        self._last_ok = self._round_start_ok = 0.0
        self._store_lost = False
        """Set at the first failed store operation: a TCPStore client does not reconnect, and every further failure
        would print a C++ stack trace. The store's silence is then judged by the age of ``_last_ok``."""
        self._gone_since: dict[int, float] = {}
        self._lock = threading.Lock()
        self._ended = False
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._signals = SignalRelay(self._on_signal)
        self._old_excepthook: Any = None
        self._launchers = launchers() if launched_by is None else list(launched_by)
        """``launchers()``, or what the caller read at the process's start (a runner that ends during a long start-up
        is then still seen gone)."""

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._store = _connect(self.timeout_s)
        self._store.set(f"info/{self.rank}", json.dumps(self.me.__dict__))
        self._store.set(f"hb/{self.rank}", "0")
        try:  # every rank starts right after ``initialize``: wait for the peers to say where they run
            self._store.wait([f"info/{r}" for r in self._pid_checked], datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - a peer that never starts its watchdog is judged by its silence
            pass
        self._read_infos()
        now = time.monotonic()
        self._last_ok = self._round_start_ok = now
        self._changed = dict.fromkeys(self.watched, now)  # a peer that never beats is stale after timeout_s
        atexit.register(self._at_exit)
        self._old_excepthook, sys.excepthook = sys.excepthook, self._excepthook
        if self.handle_signals and (reader := self._signals.install()) is not None:
            self._threads.append(reader)
        for target in (self._beat, self._judge):
            t = threading.Thread(target=target, name=f"{THREAD_PREFIX}watchdog-{target.__name__[1:]}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Mark this rank done and stop watching. Rank 0 waits (up to ``timeout_s``) for the others to be done too:
        under env:// it serves the store, and peers that lost it would take that for a fault."""
        if self._stopping.is_set() or self._store is None:
            return
        self._stopping.set()
        self._wake.set()
        atexit.unregister(self._at_exit)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._old_excepthook
        self._signals.restore()
        if self._store_lost:
            return
        try:
            self._store.set(f"hb/{self.rank}", _DONE)
            if self.rank == 0:
                keys = [f"hb/{r}" for r in range(1, self.world)]
                deadline, ended = time.monotonic() + self.timeout_s, (_DONE, _FAILED)
                while keys and time.monotonic() < deadline:
                    keys = [k for k in keys if not self._store.check([k]) or self._store.get(k).decode() not in ended]
                    time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store may be gone at the end of a job; nothing left to watch
            pass
        for t in self._threads:
            t.join(timeout=self.interval_s + 1)

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- heartbeat thread --------------------------------------------------------------------------
    def _beat(self) -> None:
        count = 1
        while not self._stopping.is_set():
            started = time.monotonic()
            host = self._infos.get(0)
            if host is not None and host.host == self.me.host and self.rank != 0 and not _process_alive(host):
                self._store_lost = True
            if not self._store_lost:
                try:
                    self._store.set(f"hb/{self.rank}", str(count))
                    count += 1
                    self._read_peers()
                    self._last_ok, self._round_start_ok = time.monotonic(), started
                except Exception:  # noqa: BLE001 - an unreachable store is judged by the age of _last_ok
                    self._store_lost = True
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _read_infos(self) -> None:
        s = self._store
        missing = [r for r in self._pid_checked if r not in self._infos and s.check([f"info/{r}"])]
        for r, raw in zip(missing, s.multi_get([f"info/{r}" for r in missing]) if missing else []):
            self._infos[r] = RankInfo(**json.loads(raw))

    def _read_peers(self) -> None:
        s = self._store
        if len(self._infos) < len(self._pid_checked):
            self._read_infos()
        present = [r for r in self.watched if r in self._state or s.check([f"hb/{r}"])]
        now = time.monotonic()
        for r, raw in zip(present, s.multi_get([f"hb/{r}" for r in present]) if present else []):
            value = raw.decode()
            if self._state.get(r) != value:
                self._state[r], self._changed[r] = value, now
        if self._posted is None and s.check(["fault"]):
            self._posted = json.loads(s.get("fault"))

    # -- judge thread ------------------------------------------------------------------------------
    def _judge(self) -> None:
        tick = 0.5
        last = time.monotonic()
        while not self._stopping.wait(tick):
            now = time.monotonic()
            if now - last > tick + self.interval_s:
                # this process itself was paused (SIGSTOP and SIGCONT, a suspended VM): the silence it sees is its
                # own, so every peer and the store get a fresh grace instead of a verdict
                self._last_ok = now
                self._changed = dict.fromkeys(self._changed, now)
                self._gone_since.clear()
            last = now
            verdict = self._verdict()
            if verdict is not None:
                self._end(*verdict)

    def _verdict(self) -> tuple[str, list[RankInfo], bool] | None:
        """(what happened, ranks to SIGKILL, post it) or None. Order matters: when the store is silent, every
        peer's counter looks stale too, so the store is judged before the peers."""
        now = time.monotonic()
        if self._posted is not None:
            return f"{self._posted['what']} (detected by rank {self._posted['by']})", [], False
        for pid, started, name in self._launchers:  # orphaned: nothing would end this rank when the job ends
            if not _alive(pid, started):
                if self.preemption is None:
                    return f"{name} (pid {pid}) is gone", [], False
                self._launchers = []  # asked once; the preemption's grace bounds the rest
                self.preemption.request_launcher_gone(f"{name} (pid {pid}) is gone")
                break
        done = {r for r, v in self._state.items() if v == _DONE}
        failed = [r for r, v in self._state.items() if v == _FAILED]
        if failed:
            return f"{self._names(failed)} failed with an error (see its own output)", [], True
        if now - self._last_ok > self.timeout_s and 0 not in done:
            host = self._infos.get(0)
            return (f"{_store_host()} has not answered for {now - self._last_ok:.1f} s (timeout {self.timeout_s:g} s):"
                    f" {host.describe() if host else 'rank 0'} is stalled or gone",
                    [host] if host else [], True)
        gone = self._gone(now, done)
        if gone:
            return f"{self._names(gone)} exited during training (its process is gone)", [], True
        stale = [r for r in self.watched if r not in done and now - self._changed[r] > self.timeout_s]
        if stale:
            ages = ", ".join(f"{now - self._changed[r]:.1f}" for r in stale)
            kill = [self._infos[r] for r in stale if r in self._infos]
            return (f"{self._names(stale)} sent no heartbeat for {ages} s (timeout {self.timeout_s:g} s): stalled or "
                    "stopped", kill, True)
        return None

    def _gone(self, now: float, done: set[int]) -> list[int]:
        """Peers on this host whose process is gone and that did not finish cleanly. A clean exit writes "done"
        just before leaving, so a vanished process counts only once a heartbeat round that started after it
        vanished still reads no "done" (or the store stays silent for a few rounds). Rank 0 counts at once: it
        leaves only after every rank is done (``stop``), and the store went with it."""
        out = []
        for r in self._pid_checked:
            info = self._infos.get(r)
            if r in done or info is None or info.host != self.me.host or _process_alive(info):
                self._gone_since.pop(r, None)
                continue
            since = self._gone_since.setdefault(r, now)
            self._wake.set()
            if r == 0 or self._round_start_ok > since or now - since > 2 * self.interval_s + 1:
                out.append(r)
        return out

    def _names(self, ranks: list[int]) -> str:
        return ", ".join(self._infos[r].describe() if r in self._infos else f"rank {r}" for r in sorted(ranks))

    # -- ending the rank ---------------------------------------------------------------------------
    def say(self, line: str) -> None:
        """A line of this rank's watchdog on stderr."""
        _say(f"ds_wallfacer watchdog on {self.me.describe()}: {line}")

    def end(self, what: str, code: int) -> None:
        """End this rank now, with a line saying ``what`` (no peer is at fault: nothing is posted)."""
        self._end(what, [], False, code=code)

    def _end(self, what: str, kill: list[RankInfo], post: bool, *, code: int = FAULT_EXIT_CODE) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        _say(f"ds_wallfacer watchdog on {self.me.describe()}: {what}; ending this rank (exit code {code}) so that "
             "the launcher ends the job")
        if post and not self._store_lost:
            self._quick(lambda: self._store.set("fault", json.dumps({"what": what, "by": self.rank})))
        for pid in [i.pid for i in kill if i.host == self.me.host and _process_alive(i)]:
            _ignore_errors(lambda pid=pid: os.kill(pid, signal.SIGKILL))
        os._exit(code)  # not sys.exit: that would wait for the main thread, which may be stuck in a collective

    def _quick(self, fn: Any) -> None:
        """A store operation that must not delay the exit: the store may be the thing that is stuck."""
        t = threading.Thread(target=lambda: _ignore_errors(fn), name=f"{THREAD_PREFIX}watchdog-quick", daemon=True)
        t.start()
        t.join(timeout=1.0)

    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        """A collective that fails because a peer died (gloo: "Connection reset by peer") is a consequence: wait
        until the peer is judged (``timeout_s`` at most) and print the verdict instead of the traceback. Any other
        error, or no verdict, gets the usual traceback."""
        text = str(exc)
        if isinstance(exc, getattr(dist, "DistError", ())) or any(s in text for s in _COMM_ERRORS):
            deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
            self._wake.set()
            while time.monotonic() < deadline:
                verdict = self._verdict()
                if verdict is not None:
                    self._end(*verdict)
                time.sleep(0.2)
        self._old_excepthook(kind, exc, tb)

    def _at_exit(self) -> None:
        # an uncaught exception leaves sys.last_value set before atexit runs: tell the peers, which would otherwise
        # wait in a collective for this rank until the launcher or the timeout ends them
        state = _FAILED if getattr(sys, "last_value", None) is not None else _DONE
        self._stopping.set()
        self._wake.set()
        if not self._store_lost:
            self._quick(lambda: self._store.set(f"hb/{self.rank}", state))
        # Note [A clean exit] (docs/trainer.md): a thread still inside a store call when the interpreter finalises
        # aborts the process ("terminate called without an active exception"): let them leave first
        self._signals.restore()
        for t in self._threads:
            t.join(timeout=self.interval_s + 1)

    # -- signals (from signals.SignalRelay) ----------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        """End this rank for a signal, with a line that names a peer on this host whose exit made the launcher send
        SIGTERM; with no such peer, a SIGTERM or SIGUSR1 goes to the preemption, if any."""
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            what = "interrupted (SIGINT)"
        else:
            done = {r for r, v in self._state.items() if v == _DONE}
            gone = [r for r in self._pid_checked if r not in done and r in self._infos
                    and self._infos[r].host == self.me.host and not _process_alive(self._infos[r])]
            if not gone and self.preemption is not None:
                self.preemption.request_signal(signum)
                return
            what = (f"stopped by {name} after {self._names(gone)} exited" if gone
                    else f"stopped by {name} (the launcher ends every rank when one fails or is interrupted)")
            if gone and not self._store_lost:  # ranks on other hosts cannot see the process: tell them
                verdict = {"what": f"{self._names(gone)} exited during training (its process is gone)", "by": self.rank}
                self._quick(lambda: self._store.set("fault", json.dumps(verdict)))
        self._end(what, [], False, code=SIGNAL_EXIT[signal.Signals(signum)])


def start_watchdog(*, timeout_s: float, interval_s: float | None = None, preemption: Any = None,
                   launched_by: list[tuple[int, float, str]] | None = None) -> Watchdog | None:
    """A started ``Watchdog`` on this rank, or None when ``timeout_s`` is 0 (off) or the world has one rank."""
    if timeout_s == 0 or dist.get_world_size() == 1:
        return None
    interval = interval_s if interval_s is not None else min(2.0, timeout_s / 4)
    return Watchdog(timeout_s=timeout_s, interval_s=interval, preemption=preemption, launched_by=launched_by).start()


def say_as_rank(line: str) -> None:
    """A line of this rank on stderr, as the watchdog's lines start (for a rank that has no watchdog)."""
    _say(f"ds_wallfacer on rank {dist.get_rank()}: {line}")


def _connect(timeout_s: float) -> Any:
    """A connection of our own to the job's rendezvous store (see the note), else torch.distributed's."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    timeout = datetime.timedelta(seconds=timeout_s)
    if addr and port:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    else:
        store = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(_PREFIX, store)


def _own_start_time() -> float:
    import psutil

    return psutil.Process().create_time()


def _ignore_errors(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def _say(line: str) -> None:
    """One line on stderr after what this rank printed so far, written whole even if the process dies next."""
    for stream in (sys.stdout, sys.stderr):
        _ignore_errors(stream.flush)
    _ignore_errors(lambda: os.write(2, (line + "\n").encode()))
