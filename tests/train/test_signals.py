"""``SignalRelay`` in this process: SIGINT and SIGTERM reach the callback (from its reader thread, so also while
the main thread would be blocked), and ``restore`` puts back the handlers it found."""
from __future__ import annotations

import os
import signal
import threading
import time

from ds_wallfacer.train.signals import SIGNAL_EXIT, SignalRelay


def test_signals_reach_the_callback_and_restore_puts_back_the_handlers() -> None:
    seen: list[tuple[int, str]] = []
    got = threading.Event()

    def on_signal(signum: int) -> None:
        seen.append((signum, threading.current_thread().name))
        got.set()

    before = {s: signal.getsignal(s) for s in SIGNAL_EXIT}
    relay = SignalRelay(on_signal)
    reader = relay.install()
    assert reader is not None and reader.is_alive()
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            got.clear()
            os.kill(os.getpid(), sig)
            assert got.wait(5), f"{sig.name} never reached the callback"
            time.sleep(0.7)  # past the grace during which a SIGTERM waits for a SIGINT, so both paths have run
            assert {s for s, _ in seen} == {int(sig)}, seen
            assert "ds_wallfacer-watchdog-signals" in {name for _, name in seen}, seen
            seen.clear()
    finally:
        relay.restore()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert {s: signal.getsignal(s) for s in SIGNAL_EXIT} == before


def test_off_the_main_thread_it_installs_nothing() -> None:
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(SignalRelay(lambda s: None).install()))
    t.start()
    t.join()
    assert result == [None]
