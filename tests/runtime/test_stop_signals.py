"""SIGTERM and SIGINT are taken on the stop thread, blocked in threads started after."""

import os
import signal
import threading
import time

from tidejax.runtime.stop import StopRequest


def _blocks(signum: int, thread_id: int) -> bool:
    """Whether the kernel thread `thread_id` of this process blocks `signum`."""
    with open(f"/proc/self/task/{thread_id}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(mask >> (signum - 1) & 1)


def test_a_signal_sets_the_stop_flag_and_later_threads_never_take_it():
    stop = StopRequest().install()
    try:
        native_id = []
        started = threading.Event()
        release = threading.Event()

        def later_thread():
            native_id.append(threading.get_native_id())
            started.set()
            release.wait(10)

        thread = threading.Thread(target=later_thread)
        thread.start()
        started.wait(10)
        assert _blocks(signal.SIGTERM, native_id[0]) and _blocks(signal.SIGINT, native_id[0])
        assert _blocks(signal.SIGTERM, threading.get_native_id())  # the installing thread
        release.set()
        thread.join()

        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.requested and stop.signum == signal.SIGTERM
    finally:
        stop.uninstall()
    assert not _blocks(signal.SIGTERM, threading.get_native_id())
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_handlers_a_library_replaced_are_taken_back():
    stop = StopRequest().install()
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as jax.distributed's notifier does
        stop.reclaim_handlers()
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert signal.getsignal(signal.SIGINT) == stop._handle
    finally:
        stop.uninstall()
