"""Launch settings and leader decisions: in one process, and across two processes of four
CPU devices each on a loopback coordinator (each bounded and killed by its own pid)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tidejax.runtime.cluster import Decisions, Launch

WORKER = os.path.join(os.path.dirname(__file__), "cluster_worker.py")


def test_launch_needs_all_three_settings_together():
    with pytest.raises(ValueError, match="--coordinator, --num-processes and --process-id"):
        Launch(coordinator="127.0.0.1:1234", num_processes=2)
    with pytest.raises(ValueError, match="--process-id"):
        Launch(coordinator="127.0.0.1:1234", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="host:port"):
        Launch(coordinator="localhost", num_processes=2, process_id=0)
    assert not Launch().distributed and Launch(auto=True).distributed


def test_one_process_decides_for_itself():
    decisions = Decisions(process_id=0, num_processes=1)
    assert decisions.client is None
    assert decisions.decide("plan", lambda: {"rollout": 3}) == {"rollout": 3}
    decisions.barrier("train")  # nothing to wait for
    assert decisions.count == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(scenario: str, timeout_s: int, limit_s: float = 120.0):
    """Both processes' (exit code, stdout, stderr) and the wall time until both ended."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    port = _free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(pid), scenario,
                               str(timeout_s)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, limit_s - (time.monotonic() - start)))
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results, time.monotonic() - start


def test_two_processes_read_the_leaders_decisions():
    results, _ = _run_pair("agree", timeout_s=30)
    for code, out, err in results:
        assert code == 0, err[-2000:]
    seen = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert [s["process"] for s in seen] == [0, 1]
    for s in seen:
        assert (s["processes"], s["local_devices"], s["devices"]) == (2, 4, 8)
        assert s["plan"] == {"from": 0}  # the leader's value, not the process's own
        assert s["ready"] == [2, 3]  # both processes' digests, decided on by the leader
        assert s["batch"] == [3, 1, 2]


def test_a_skipped_decision_fails_both_processes_naming_the_stage():
    # Process 1 skips the "plan" decision (a desynchronised control loop): it reads the
    # leader's "plan" where it expects the "train" barrier and fails at once; the leader then
    # waits at that barrier and fails when the timeout passes. Neither hangs.
    results, wall = _run_pair("skip", timeout_s=10)
    (code0, _, err0), (code1, _, err1) = results
    assert code1 == 3 and "process 1 is at stage 'train', the leader is at 'plan'" in err1
    assert code0 != 0 and "stage 'train'" in err0
    assert wall < 60


def _job(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tidejax.experiments.webshop", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_warm_start_only_run_across_processes_is_refused_at_start(tmp_path):
    # --sft-only builds the warm start on one process's devices: every process says so and
    # exits 2 before training anything, instead of hanging in mismatched collectives.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # --devices sets the fake device count per process
    port = _free_port()
    procs = [_job(["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(pid), "--devices", "4", "--quick", "--sft-only",
                   "--process-timeout", "20", "--out", str(tmp_path / "run")], env)
             for pid in (0, 1)]
    try:
        results = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 2, err[-2000:]
        assert "--sft-only builds a warm start on one process's devices" in err
    assert not (tmp_path / "run" / "sft_params.npz").exists()


def test_an_incomplete_launch_is_refused_before_anything_starts():
    proc = _job(["--coordinator", "127.0.0.1:1", "--num-processes", "2"],
                {**os.environ, "JAX_PLATFORMS": "cpu"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "bad launch" in err and "--process-id" in err
