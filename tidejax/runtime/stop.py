"""Stopping a run on SIGINT or SIGTERM: finish at the next safe boundary, or exit at once.

Threads: `StopRequest.install` blocks both signals in the calling (main) thread, and so in
every thread started after it, native ones included, and takes them on a daemon thread of
its own ("stop-signals", `signal.sigwait`), with the same handler set on the main
thread for any thread that was already running. No signal then interrupts a system call in
another thread (once, in CI, a SIGTERM that arrived during a cross-process collective
aborted the process in gloo: "Received data size doesn't match expected size"). The
first signal sets a `threading.Event` that the controller's asyncio loop and the SFT loop
poll (from any thread), so the run checkpoints at its next safe boundary and returns. A
second signal ends the process at once with `os._exit`, skipping cleanup (the last
checkpoint on disk stays whole: Orbax commits a step by renaming it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run stopped on request before its last step (`step`: the last completed one,
    None when it stopped before GRPO started)."""

    def __init__(self, signum: int, step: int | None = None):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum = signum
        self.step = step

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StopRequest:
    """A stop flag set by the first SIGINT/SIGTERM; the second one exits immediately."""

    def __init__(self):
        self._event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._installed = False

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, signum: int = signal.SIGTERM) -> None:
        if self.signum is None:
            self.signum = signum
        self._event.set()

    def raise_if_requested(self, step: int | None = None) -> None:
        if self.requested:
            raise RunStopped(self.signum, step)

    def install(self) -> StopRequest:
        """Take SIGINT and SIGTERM on the "stop-signals" thread until `uninstall`. Call it
        before anything starts threads (jax.distributed, the XLA backend). A thread started
        earlier (a BLAS pool at import) may still receive one: the handler set here then runs
        it on the main thread, as Python does."""
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        self._installed = True
        threading.Thread(target=self._wait_for_signals, name="stop-signals",
                         daemon=True).start()
        return self

    def reclaim_handlers(self) -> None:
        """Set the main-thread handlers again after a library replaced them (jax.distributed
        installs a preemption notifier for SIGTERM)."""
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Signals reach the calling thread again, with the handlers it had before."""
        self._installed = False
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)

    def _wait_for_signals(self) -> None:
        while True:
            signum = signal.sigwait(SIGNALS)
            if self._installed:
                self._handle(signum, None)
            else:  # uninstalled: to a thread that takes it again, as it would have gone
                os.kill(os.getpid(), signum)
                return

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"\n{name} again: exiting now, without a final checkpoint.", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.request(signum)
        print(f"\n{name}: stopping at the next safe boundary and writing a checkpoint "
              "(send it again to exit at once).", file=sys.stderr, flush=True)
