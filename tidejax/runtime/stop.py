"""Stopping a run on SIGINT or SIGTERM: finish at the next safe boundary, or exit at once.

Threads: Python runs signal handlers on the main thread only. `StopRequest.install` puts a
handler there; the first signal sets a `threading.Event` that the controller's asyncio loop
and the SFT loop poll (from any thread), so the run checkpoints at its next safe boundary
and returns. A second signal ends the process at once with `os._exit`, skipping cleanup
(the last checkpoint on disk stays whole: Orbax commits a step by renaming it).
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
        """Handle SIGINT and SIGTERM in this (the main) thread until `uninstall`."""
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"\n{name} again: exiting now, without a final checkpoint.", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.request(signum)
        print(f"\n{name}: stopping at the next safe boundary and writing a checkpoint "
              "(send it again to exit at once).", file=sys.stderr, flush=True)
