"""Goodput accounting and run outputs: JSONL metrics, TensorBoard events, Perfetto traces.

Goodput is the headline number: generated tokens that reach the trainer and advance an
update, per wall-clock second. Tokens generated but dropped (stale, failed groups) are
counted separately and never enter goodput.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


def format_eta(seconds: float) -> str:
    """Seconds as `MmSSs`, for progress lines."""
    minutes, secs = divmod(max(0, round(seconds)), 60)
    return f"{minutes}m{secs:02d}s"


class GoodputMeter:
    """Counts generated, consumed and dropped tokens against a wall clock (thread-safe)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.start = clock()
        self.generated = 0
        self.consumed = 0
        self.dropped = 0

    def add_generated(self, n: int) -> None:
        with self._lock:
            self.generated += n

    def add_consumed(self, n: int) -> None:
        with self._lock:
            self.consumed += n

    def add_dropped(self, n: int) -> None:
        with self._lock:
            self.dropped += n

    def elapsed(self) -> float:
        return max(self._clock() - self.start, 1e-9)

    def goodput(self) -> float:
        """Consumed generated tokens per second since the meter started."""
        return self.consumed / self.elapsed()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"generated_tokens": self.generated, "consumed_tokens": self.consumed,
                    "dropped_tokens": self.dropped, "elapsed_s": self.elapsed(),
                    "goodput_tok_s": self.consumed / self.elapsed()}


class MetricsWriter:
    """Writes one JSON line per record and mirrors scalars to TensorBoard (process 0 only)."""

    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._tb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional dependency path, imported late

            self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def write(self, step: int, kind: str, values: dict[str, Any], scalars: bool = True) -> None:
        """`scalars=False` keeps a record (an episode transcript, say) out of TensorBoard."""
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time": time.time(), **values}
        self._file.write(json.dumps(record, default=float) + "\n")
        if self._tb is not None and scalars:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class TraceRecorder:
    """Perfetto / Chrome trace events: one track per device (pid) and activity lane (tid)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self.events: list[dict] = []

    def now_us(self) -> float:
        return (self._clock() - self._t0) * 1e6

    def complete(self, name: str, track: str, start_us: float, end_us: float,
                 lane: str = "main", **args: Any) -> None:
        event = {"name": name, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                 "pid": track, "tid": lane, "args": args}
        with self._lock:
            self.events.append(event)

    def span(self, name: str, track: str, lane: str = "main", **args: Any):
        recorder = self

        class _Span:
            def __enter__(self):
                self.start = recorder.now_us()
                return self

            def __exit__(self, *exc):
                recorder.complete(name, track, self.start, recorder.now_us(), lane, **args)

        return _Span()

    def save(self, path: str) -> None:
        with self._lock:
            data = {"traceEvents": list(self.events), "displayTimeUnit": "ms"}
        with open(path, "w") as f:
            json.dump(data, f)
