"""The asynchronous trainer consumes groups in admission order (or deadline order) and frees
their quota slots only once rollout runs the new version: no group is dropped for being
slow, and no trained token is more than `staleness_bound` versions old (the job, through
the CLI)."""

import json
import subprocess

import pytest

from tests.runtime.test_crash_resume import ROOT, job_cmd, job_env

STEPS = 5
ASYNC_WITH_SLOW_GROUPS = {
    "system": "async", "steps": STEPS, "eval_every": 0, "batch_groups": 2,
    "min_batch_groups": 1, "group_size": 2, "max_turns": 4, "env_time_scale": 0.05,
    "long_tail_fraction": 0.3, "checkpoint_every": 0, "sft": {"steps": 0, "episodes": 8},
    "rollout": {"staleness_bound": 1}}


# Admission order (no longer the default) runs with -m slow; the 2-process test's first run
# also takes its batches in admission order.
@pytest.mark.parametrize("order", [pytest.param("admission", marks=pytest.mark.slow),
                                   "deadline"])
def test_async_job_drops_nothing_stale_and_stays_within_the_bound(tmp_path, order):
    config = tmp_path / "async.json"
    job = dict(ASYNC_WITH_SLOW_GROUPS,
               rollout=dict(ASYNC_WITH_SLOW_GROUPS["rollout"], consume_order=order))
    config.write_text(json.dumps(job))
    out = tmp_path / "run"
    proc = subprocess.run(job_cmd(config, out, tmp_path / "cache"), cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    assert len(steps) == STEPS
    assert all(r["batch_groups"] == 2 for r in steps)
    assert max(r["loss/staleness_max"] for r in steps) <= 1
    assert max(r["loss/staleness_max"] for r in steps) == 1  # it did run asynchronously
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped_tokens"] == 0
