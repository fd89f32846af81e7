"""SIGKILL the job mid-step, `--resume` it, and land on the uninterrupted run's parameters.

`--system sync` with fixed seeds is deterministic end to end (sampling seeds come from task
ids, batches are sorted by group id), so a run killed after its first checkpoint and
resumed must end with the same TrainState, and train on the same tokens, as a run that was
never interrupted. The config is `--quick`'s without the SFT warm start (whose compile
would double the test's time and which a resume only reads from its cache).

Sensitivity: the tiny model earns no reward here, so updates come from the KL term and
weight decay; Adam turns those small gradients into full-size steps, so different rollout
tokens do move the parameters (before sampling seeds were derived, two uninterrupted runs
of this config differed by 1.5e-5 after three steps). The per-step token counts and KL
values are compared as well.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
DEVICES = 2
QUICK_WITHOUT_SFT = {
    "system": "sync", "steps": STEPS, "eval_every": 2, "eval_groups": 2, "batch_groups": 2,
    "min_batch_groups": 1, "group_size": 2, "max_turns": 3, "env_time_scale": 0.05,
    "checkpoint_every": 1, "sft": {"steps": 0, "episodes": 8}}


def job_cmd(config, out, cache, *extra):
    return [sys.executable, "-m", "tidejax.experiments.webshop", "--config", str(config),
            "--no-progress", "--devices", str(DEVICES), "--out", str(out),
            "--compile-cache", str(cache), *extra]


def job_env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the job sets its own device count
    return env


def finished_steps(run_dir):
    ckpt = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())


def load_state(run_dir, step):
    """A checkpoint's TrainState as numpy, read without the job's abstract state."""
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(run_dir, "checkpoints", str(step), "state")
    reader = ocp.StandardCheckpointer()
    meta = reader.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), meta)
    return jax.device_get(reader.restore(path, abstract))


def step_records(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "step"}


def max_abs_diff(a, b) -> float:
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(la, lb))


def test_sigkill_mid_step_then_resume_equals_uninterrupted(tmp_path):
    cache, ref, crashed = tmp_path / "cache", tmp_path / "ref", tmp_path / "crashed"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QUICK_WITHOUT_SFT))
    t0 = time.perf_counter()
    first = subprocess.run(job_cmd(config, ref, cache), cwd=ROOT, env=job_env(),
                           capture_output=True, text=True, timeout=1200, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    t_ref = time.perf_counter() - t0

    crashed.mkdir()  # the same (deterministic) tokenizer, without training it again
    shutil.copy(ref / "tokenizer.json", crashed / "tokenizer.json")
    t0 = time.perf_counter()
    with open(tmp_path / "crashed.log", "w") as log:  # a file, not a pipe nobody drains
        proc = subprocess.Popen(job_cmd(config, crashed, cache), cwd=ROOT, env=job_env(),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 900
            while not finished_steps(crashed) and proc.poll() is None:
                assert time.monotonic() < deadline, "no checkpoint appeared"
                time.sleep(0.1)
            assert proc.poll() is None, f"job ended before it was killed: {proc.returncode}"
            proc.send_signal(signal.SIGKILL)  # mid-step: step 2's rollout is under way
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL
    killed_at = finished_steps(crashed)[-1]
    assert killed_at < STEPS, (tmp_path / "crashed.log").read_text()[-2000:]
    t_crash = time.perf_counter() - t0

    t0 = time.perf_counter()
    resumed = subprocess.run(job_cmd(config, crashed, cache, "--resume"), cwd=ROOT,
                             env=job_env(), capture_output=True, text=True, timeout=1200,
                             check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    t_resume = time.perf_counter() - t0
    match = re.search(r"resumed from step (\d+)", resumed.stderr)
    assert match and int(match.group(1)) == killed_at, resumed.stderr[-3000:]
    assert "restored rollout: 0 ready groups, 0 in-flight tasks restarted" in resumed.stderr
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["steps"] == STEPS - killed_at  # only the remaining steps ran

    a, b = load_state(ref, STEPS), load_state(crashed, STEPS)
    assert int(a["step"]) == int(b["step"]) == STEPS
    assert int(b["policy_version"]) == STEPS
    np.testing.assert_array_equal(a["key"], b["key"])
    diff = max_abs_diff(a["params"], b["params"])
    print(f"\ncrash-resume: killed after step {killed_at}, max |param diff| = {diff:.3g} "
          f"(ref {t_ref:.0f}s, crashed {t_crash:.0f}s, resumed {t_resume:.0f}s)")
    assert diff <= 1e-6
    ref_steps, resumed_steps = step_records(ref), step_records(crashed)
    for step in range(killed_at + 1, STEPS + 1):
        want, got = ref_steps[step], resumed_steps[step]
        for key in ("batch_groups", "consumed_tokens", "loss/tokens"):
            assert want[key] == got[key], (step, key)
        for key in ("loss/kl", "loss/grad_norm", "train_reward"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=0, err_msg=key)
    assert max_abs_diff(a["opt_state"], b["opt_state"]) <= 1e-6


def wait_for(predicate, proc, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert proc.poll() is None, f"job ended before {what}: {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def stop_cmd(tmp_path, out, *extra):
    """`--quick` with a config file that writes no scheduled checkpoint: the only checkpoint
    of an interrupted run is the one the stop writes."""
    config = tmp_path / "stop.json"
    config.write_text(json.dumps({"steps": 4, "checkpoint_every": 0}))
    return [sys.executable, "-m", "tidejax.experiments.webshop", "--quick", "--config",
            str(config), "--sft-steps", "0", "--devices", str(DEVICES), "--out", str(out),
            "--compile-cache", str(tmp_path / "cache"), *extra]


@contextlib.contextmanager
def logged_job(cmd, log_path):
    """The job as a subprocess writing to `log_path`, killed if the test leaves it running."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def test_sigterm_checkpoints_at_the_next_boundary_then_resume_finishes(tmp_path):
    out = tmp_path / "run"
    log_path = tmp_path / "stopped.log"
    with logged_job(stop_cmd(tmp_path, out), log_path) as proc:
        wait_for(lambda: 1 in step_records_or_empty(out), proc, 900, "step 1")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    text = log_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    stopped_at = finished_steps(out)
    assert len(stopped_at) == 1 and 1 <= stopped_at[0] < 4, (stopped_at, text[-2000:])
    assert sorted(step_records(out)) == list(range(1, stopped_at[0] + 1))
    match = re.search(r"Resume with:\n\s+(.+)", text)
    assert match, text[-2000:]
    printed = match.group(1).split()
    assert printed[:3] == ["python", "-m", "tidejax.experiments.webshop"]
    assert printed[-1] == "--resume"

    resumed = subprocess.run([sys.executable, *printed[1:]], cwd=ROOT, env=job_env(),
                             capture_output=True, text=True, timeout=1200, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stopped_at[0]}" in resumed.stderr
    assert sorted(step_records(out)) == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4 - stopped_at[0]


def step_records_or_empty(run_dir) -> dict[int, dict]:
    return step_records(run_dir) if (run_dir / "metrics.jsonl").exists() else {}


def test_a_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "run"
    log_path = tmp_path / "twice.log"
    with logged_job(stop_cmd(tmp_path, out), log_path) as proc:
        wait_for(lambda: (out / "config.json").exists(), proc, 300, "the run to start")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping at the next safe boundary" in log_path.read_text(),
                 proc, 60, "the first signal's message")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "SIGTERM again: exiting now" in text
