"""The WebShop job end to end (shortened), as a user runs it: outputs, then --resume."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_job(out, cache, *extra):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the job sets its own device count
    cmd = [sys.executable, "-m", "tidejax.experiments.webshop", "--quick", "--no-progress",
           "--devices", "4", "--out", str(out), "--compile-cache", str(cache), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def test_quick_job_writes_outputs_and_resumes(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    first = run_job(out, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["consumed_tokens"] > 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == [1, 2]
    evals = [r for r in steps if r["kind"] == "eval"]
    transcripts = [r for r in steps if r["kind"] == "eval_episode"]
    assert evals and len(transcripts) == sum(r["episodes"] for r in evals)
    assert all(t["actions"] and t["end"] in ("env_done", "context_cap") for t in transcripts)
    for name in ("trace.json", "plots.png", "tokenizer.json", "sft_params.npz"):
        assert (out / name).exists(), name
    assert (out / "tensorboard").is_dir() and any((out / "checkpoints").iterdir())
    assert "system=tide steps=2" in first.stdout

    resumed = run_job(out, cache, "--resume", "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stderr
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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
