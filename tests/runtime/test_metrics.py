"""Goodput meter, JSONL/TensorBoard writer and Perfetto trace output."""

import json

from tidejax.metrics import GoodputMeter, MetricsWriter, TraceRecorder, read_jsonl


def test_goodput_counts_only_consumed_tokens():
    t = [0.0]
    meter = GoodputMeter(clock=lambda: t[0])
    meter.add_generated(1000)
    meter.add_consumed(600)
    meter.add_dropped(400)
    t[0] = 2.0
    snap = meter.snapshot()
    assert snap["goodput_tok_s"] == 300.0 and snap["dropped_tokens"] == 400


def test_writer_and_trace(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, "train", {"loss": 0.5, "note": "x"})
    writer.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert rows[0]["loss"] == 0.5 and rows[0]["kind"] == "train"
    assert any((tmp_path / "tensorboard").iterdir())
    trace = TraceRecorder()
    with trace.span("decode", track="cpu:0", lane="rollout"):
        pass
    trace.save(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert events[0]["ph"] == "X" and events[0]["pid"] == "cpu:0"
