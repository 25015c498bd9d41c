"""A rank that dies, stalls or is interrupted ends the whole job within seconds, with one line naming it.

    watchdog = Watchdog(timeout_s=30).start()     # after ``initialize``; every rank
    ...train...
    watchdog.stop()

Note [Watchdog: heartbeats from a thread, over the rendezvous store]
A collective blocked on a dead or stopped peer cannot be interrupted from Python, and the process groups'
timeout (``collective_timeout_s``) must be longer than the longest legitimate step, so it is no fault detector.
Every rank runs two daemon threads. One writes a counter to the job's rendezvous TCPStore every ``interval_s``
and reads its peers' counters; the other judges them. They run beside the training loop (torch ops and
collectives release the GIL), so a step that takes minutes never looks stalled, while a SIGSTOPped process stops
all its threads and so its heartbeat. The threads open their own connection to the store (MASTER_ADDR /
MASTER_PORT), not torch.distributed's client, whose lock a long ``wait`` in the main thread may hold; the store
works the same whatever the collective backend (gloo, NCCL). Staleness is measured on the watcher's own monotonic
clock (time since a peer's counter last changed), so the clocks of different hosts are never compared.

Verdicts: a peer on this host whose process is gone (pid and start time), at once; a peer that raised (its
``atexit`` hook marks it "failed"), at once; a peer silent for ``timeout_s``; the store itself silent for
``timeout_s`` (its host process, rank 0 under the env:// rendezvous, is stopped or gone); this rank's launcher
or the ``deepspeed`` runner gone (the rank was orphaned, and nothing would end it). The first rank to judge
posts its verdict in the store, so the other ranks print the same names. Each rank then prints ONE line and
leaves with ``os._exit``: its main thread may be stuck in a collective that nothing else would end. A stalled
peer on this host is also SIGKILLed: stopped, or stuck holding the GIL, it would not act on the launcher's
SIGTERM, and the launcher waits 30 s before it sends SIGKILL. (So native code that holds the GIL for longer than
``timeout_s`` looks stalled too: choose the timeout above the longest such call.) A collective that raises
because a peer vanished (gloo sees the closed connection at once) does not print its traceback: the rank waits
for the verdict and prints that instead.

SIGINT (Ctrl-C) and SIGTERM (the launcher stopping the job after another rank failed) end the rank the same way,
with one line instead of a traceback per thread. Python runs signal handlers in the main thread only, and only
between bytecodes; a main thread blocked in a collective would never run one. So the signals also reach a third
thread through ``signal.set_wakeup_fd``.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["FAULT_EXIT_CODE", "RankInfo", "Watchdog", "start_watchdog"]

FAULT_EXIT_CODE = 3
"""Exit status of a rank that the watchdog ends because another rank died or stalled."""
_PREFIX = "ds_wallfacer/watchdog"
_DONE, _FAILED = "done", "failed"
_COMM_ERRORS = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer")
"""Text of the errors a collective raises when a peer vanishes."""
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # the shell's 128 + signal number
_SIGINT, _SIGTERM = int(signal.SIGINT), int(signal.SIGTERM)
_CTRL_C_GRACE_S = 0.5
"""Ctrl-C reaches every process of the job at once and the launcher answers it with SIGTERM: a SIGINT that
arrives within this grace after a SIGTERM wins, so the rank's line says what the user did."""


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


def _launchers() -> list[tuple[int, float, str]]:
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
    """Heartbeat, judge and signal threads of one rank (see the note above). ``start()`` on every rank after
    torch.distributed is initialised; ``stop()`` at the end of training (also ``with Watchdog(...):``)."""

    def __init__(self, *, timeout_s: float = 30.0, interval_s: float = 2.0, max_watched: int = 64,
                 handle_signals: bool = True) -> None:
        if not timeout_s > 0 or not 0 < interval_s < timeout_s:
            raise ValueError(f"watchdog timeout_s = {timeout_s} and interval_s = {interval_s}: both must be positive"
                             " and the interval shorter than the timeout")
        self.timeout_s, self.interval_s, self.handle_signals = float(timeout_s), float(interval_s), handle_signals
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
        self._pipe: tuple[int, int] | None = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        self._old_excepthook: Any = None
        self._launchers = _launchers()

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
        if self.handle_signals:
            self._install_signals()
        for target in (self._beat, self._judge):
            t = threading.Thread(target=target, name=f"ds_wallfacer-watchdog-{target.__name__[1:]}", daemon=True)
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
        self._restore_signals()
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
                return f"{name} (pid {pid}) is gone", [], False
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
        t = threading.Thread(target=lambda: _ignore_errors(fn), daemon=True)
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
        if not self._store_lost:
            self._quick(lambda: self._store.set(f"hb/{self.rank}", state))

    # -- signals -----------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may install handlers; the caller keeps Python's defaults
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_handlers = {s: signal.signal(s, self._on_signal_main) for s in _SIGNAL_EXIT}
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        t = threading.Thread(target=self._signal_reader, name="ds_wallfacer-watchdog-signals", daemon=True)
        t.start()
        self._threads.append(t)

    def _restore_signals(self) -> None:
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        os.write(self._pipe[1], b"\0")  # wakes the reader, which then closes the pipe

    def _signal_reader(self) -> None:
        r, w = self._pipe
        while True:
            data = os.read(r, 64)
            if _SIGTERM in data and _SIGINT not in data and select.select([r], [], [], _CTRL_C_GRACE_S)[0]:
                data += os.read(r, 64)
            forward = data.replace(b"\0", b"")
            if self._old_wakeup >= 0 and forward:  # whoever had the wakeup fd before still gets its bytes
                _ignore_errors(lambda forward=forward: os.write(self._old_wakeup, forward))
            for signum in (_SIGINT, _SIGTERM):
                if signum in data:
                    self._on_signal(signum)
            if b"\0" in data:
                os.close(r)
                os.close(w)
                return

    def _on_signal_main(self, signum: int, frame: Any) -> None:
        # the reader thread normally acts first; this runs only if the main thread gets to Python before it
        if signum == _SIGTERM:
            time.sleep(_CTRL_C_GRACE_S)
        self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGINT:
            what = "interrupted (SIGINT)"
        else:
            done = {r for r, v in self._state.items() if v == _DONE}
            gone = [r for r in self._pid_checked if r not in done and r in self._infos
                    and self._infos[r].host == self.me.host and not _process_alive(self._infos[r])]
            what = (f"stopped by SIGTERM after {self._names(gone)} exited" if gone
                    else "stopped by SIGTERM (the launcher ends every rank when one fails or is interrupted)")
            if gone and not self._store_lost:  # ranks on other hosts cannot see the process: tell them
                verdict = {"what": f"{self._names(gone)} exited during training (its process is gone)", "by": self.rank}
                self._quick(lambda: self._store.set("fault", json.dumps(verdict)))
        self._end(what, [], False, code=_SIGNAL_EXIT[signal.Signals(signum)])


def start_watchdog(*, timeout_s: float, interval_s: float | None = None) -> Watchdog | None:
    """A started ``Watchdog`` on this rank, or None when ``timeout_s`` is 0 (off) or the world has one rank."""
    if timeout_s == 0 or dist.get_world_size() == 1:
        return None
    interval = interval_s if interval_s is not None else min(2.0, timeout_s / 4)
    return Watchdog(timeout_s=timeout_s, interval_s=interval).start()


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
