"""The WebShop job end to end (shortened), as a user runs it: from the repository root,
through the CLI, with a relative run directory and the default compilation cache; then
--resume."""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_job(out, *extra):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the job sets its own device count
    cmd = [sys.executable, "-m", "tidejax.experiments.webshop", "--quick", "--devices", "4",
           "--out", out, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture
def relative_run_dir():
    """A fresh run directory under the repository's runs/ (ignored by git), given relative."""
    rel = os.path.join("runs", "test-job", uuid.uuid4().hex[:8])
    yield rel
    shutil.rmtree(os.path.join(ROOT, rel), ignore_errors=True)


def assert_clean_output(proc):
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text[-3000:]
    assert "Unable to initialize backend" not in text
    assert "WARNING" not in text, [line for line in text.splitlines() if "WARNING" in line]


def test_quick_job_writes_outputs_and_resumes(relative_run_dir):
    first = run_job(relative_run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert_clean_output(first)
    out = os.path.join(ROOT, relative_run_dir)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["consumed_tokens"] > 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    assert [r["step"] for r in steps if r["kind"] == "step"] == [1, 2]
    evals = [r for r in steps if r["kind"] == "eval"]
    transcripts = [r for r in steps if r["kind"] == "eval_episode"]
    assert evals and len(transcripts) == sum(r["episodes"] for r in evals)
    assert all(t["actions"] and t["end"] in ("env_done", "context_cap") for t in transcripts)
    for name in ("trace.json", "plots.png", "tokenizer.json", "sft_params.npz"):
        assert os.path.exists(os.path.join(out, name)), name
    assert os.path.isdir(os.path.join(out, "tensorboard"))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["1", "2"]
    assert "system=tide steps=2" in first.stdout
    last = first.stdout.strip().splitlines()[-1]
    assert last.startswith(f"outputs in {relative_run_dir}/: metrics.jsonl"), last
    assert f"tensorboard --logdir {relative_run_dir}/tensorboard" in last
    assert "step 2/2:" in first.stderr and " eta " in first.stderr  # progress with an ETA

    resumed = run_job(relative_run_dir, "--resume", "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stderr
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    assert [r["step"] for r in steps if r["kind"] == "step"] == [1, 2, 3]


def test_bad_config_fails_at_start_naming_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rollout": {"max_new_tokens": 0}}))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "tidejax.experiments.webshop", "--config",
                           str(bad), "--out", str(tmp_path / "x")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "max_new_tokens" in proc.stderr
    assert not (tmp_path / "x").exists()  # nothing half-written


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


class _FinishedController:
    """Stands in for the Controller: `run` returns (or raises) at once."""

    def __init__(self, pool, error: Exception | None = None):
        self.pool, self.error, self.progress = pool, error, None

    async def run(self, state, start_step, rollout=None):
        if self.error is not None:
            raise self.error
        return "summary"


def _worker_threads_end(pool, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pool._workers.live and time.monotonic() < deadline:
        time.sleep(0.01)
    return pool._workers.live == 0


@pytest.mark.parametrize("error", [None, RuntimeError("the run failed")])
def test_the_job_closes_its_env_pool_when_the_run_ends(error):
    from tidejax.config import RunConfig
    from tidejax.envs.pool import EnvPool, PoolConfig
    from tidejax.runtime.job import _run_with_progress

    pool = EnvPool(PoolConfig(workers=3))
    assert pool._workers.live == 3
    controller = _FinishedController(pool, error)
    if error is None:
        assert _run_with_progress(controller, None, 0, RunConfig(), False) == "summary"
    else:
        with pytest.raises(RuntimeError, match="the run failed"):
            _run_with_progress(controller, None, 0, RunConfig(), False)
    assert _worker_threads_end(pool)
