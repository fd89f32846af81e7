"""The job across two processes of four CPU devices each on a loopback coordinator: tide
steps with a forced ERS move and checkpoints, `--resume` on two processes stopped by a
SIGTERM to one of them, `--resume` on one process; sync steps with each host's share of
the batch; and a desynchronised control loop that fails fast naming the stage. Every
process is bounded by a timeout and killed by its own pid; its output goes to a file the
test reads."""

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "job_worker.py")
DIGEST = re.compile(r"step (\d+) digest: (.*)$", re.MULTILINE)
LIMIT_S = 420.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the worker asks for 4 devices per process
    return env


def _job_args(out, steps: int, extra=()) -> list[str]:
    # A compile cache beside the run: the resumed runs reuse what the first one compiled.
    return ["--devices", "4", "--quick", "--no-progress", "--steps", str(steps),
            "--compile-cache", os.path.join(os.path.dirname(out), "xla_cache"),
            "--out", str(out), *extra]


def _run(tmp_path, name: str, hook: str, args: list[str], processes: int,
         timeout_s: int = 120, sigterm_when: tuple[int, str] | None = None
         ) -> list[tuple[int, str]]:
    """(exit code, log) of each process; `sigterm_when=(pid, text)` sends SIGTERM to that
    process once its log shows `text`."""
    port = _free_port()
    logs = [tmp_path / f"{name}.p{pid}.log" for pid in range(processes)]
    procs = []
    try:
        for pid, log in enumerate(logs):
            launch = ([] if processes == 1 else
                      ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                       "--process-id", str(pid), "--process-timeout", str(timeout_s)])
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, WORKER, hook, *args, *launch],
                                              env=_env(), stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + LIMIT_S
        if sigterm_when is not None:
            pid, text = sigterm_when
            while text not in logs[pid].read_text():
                assert time.monotonic() < deadline and procs[pid].poll() is None, \
                    logs[pid].read_text()[-3000:]
                time.sleep(0.5)
            procs[pid].send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def _digests(log: str) -> dict[int, str]:
    return {int(step): text for step, text in DIGEST.findall(log)}


def _steps_written(out) -> list[int]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if r["kind"] == "step"]


def _resumed_partition(log: str) -> str:
    """The partition a resumed run says ERS goes on from, as a step digest writes it."""
    p = re.search(r"resuming ERS at partition Partition\(rollout=(\d+), actor=(\d+), "
                  r"ref=(\d+)\)", log)
    assert p, log[-3000:]
    return f"({p.group(1)}, {p.group(3)}, {p.group(2)})"


def _partitions(log: str) -> dict[int, str]:
    """Each step's partition after its boundary's plan, from the step digests."""
    return {step: re.search(r"partition=(\(.*?\))", d).group(1)
            for step, d in _digests(log).items()}


def test_tide_across_two_processes_moves_stops_and_resumes_on_two_and_on_one(tmp_path):
    out = tmp_path / "run"
    split = tmp_path / "split.toml"  # tide starts from this split: 3 rollout ranks per host
    split.write_text("[topology]\nrollout_ranks = 3\n")
    # The first run takes groups in admission order, so its batches mix both hosts' groups
    # (asserted below); the resumed runs in deadline order, the default, where a batch may
    # be one host's fast groups and the batch shares keep places for due groups running on
    # either host.
    admission = tmp_path / "admission.toml"
    admission.write_text(split.read_text() + '[rollout]\nconsume_order = "admission"\n')
    first = _run(tmp_path, "first", "move",
                 _job_args(out, steps=3, extra=["--config", str(admission)]), processes=2)
    for code, log in first:
        assert code == 0, log[-3000:]
    digests = [_digests(log) for _, log in first]
    assert sorted(digests[0]) == [1, 2, 3] and digests[0] == digests[1]
    # The forced move at step 1's boundary: 3 rollout ranks and 1 actor device per host
    # became 2 and 2, so the state moved from a 2-device to a 4-device mesh over both
    # processes, each host's block staying on its host (not through the host memory).
    # Step 2's boundary queues an evaluation (--quick evaluates every 2 steps): ERS lends
    # it a trainer rank on each host and takes it back at step 3's.
    partitions = _partitions(first[0][1])
    assert partitions == {1: "(2, 0, 2)", 2: "(3, 0, 1)", 3: "(2, 0, 2)"}, partitions
    assert all("actor_processes=[0, 1]" in d for d in digests[0].values())
    for _, log in first:
        assert "through the host" not in log
    # A batch holds groups of both hosts' streams (process 1's ids start "p1.").
    batches = [d.split("groups=")[1].split(",") for d in digests[0].values()]
    assert any(any(g.startswith("p1.") for g in b) and any(not g.startswith("p1.") for g in b)
               for b in batches)
    for pid, (_, log) in enumerate(first):  # every sync landed on each host's own ranks
        synced = re.findall(rf"sync v(\d+): \d+ rollout rank\(s\) on process {pid} hold "
                            r"the trainer's weights", log)
        assert synced == ["1", "2", "3"]
    fingerprints = [re.findall(r"fingerprint (\w+)", log) for _, log in first]
    assert fingerprints[0] == fingerprints[1]
    assert _steps_written(out) == [1, 2, 3]  # only process 0 wrote metrics
    with open(os.path.join(out, "metrics.jsonl")) as f:
        reasons = [r["reason"] for r in map(json.loads, f) if r["kind"] == "step"]
    assert reasons[0] == "forced move (test)"
    assert reasons[1].startswith("preemptive generation") and reasons[2].startswith(
        "evaluation over"), reasons

    # Resumed on two processes, then SIGTERM to process 1 only: both stop at the next
    # boundary, checkpoint, and exit 128 + SIGTERM.
    second = _run(tmp_path, "second", "none",
                  _job_args(out, steps=30, extra=["--resume", "--config", str(split)]),
                  processes=2, sigterm_when=(1, "step 4 digest"))
    for code, log in second:
        assert code == 128 + signal.SIGTERM, log[-3000:]
        assert "resumed from step 3" in log
        assert log.count("restored rollout") == 1  # each host its own snapshot
        # ERS goes on from the checkpoint's partition (step 3's plan), not the configured
        # split (3, 0, 1)
        assert _resumed_partition(log) == partitions[3] == "(2, 0, 2)", log[-3000:]
    assert _digests(second[0][1]) == _digests(second[1][1])
    stopped = int(re.search(r"stopping after step (\d+) of 30", second[0][1]).group(1))
    assert stopped >= 4 and f"stopped by SIGTERM after step {stopped} of 30" in second[1][1]
    assert str(stopped) in os.listdir(out / "checkpoints")

    (code, log), = _run(tmp_path, "third", "none",
                        _job_args(out, steps=stopped + 1,
                                  extra=["--resume", "--config", str(split)]),
                        processes=1)
    assert code == 0, log[-3000:]
    assert f"resumed from step {stopped}" in log
    assert log.count("restored rollout") == 2  # process 1's groups re-homed here
    # the partition is per host, so one host of the same shape resumes it too, with the
    # plan's state: a rank lent to the evaluation queued at the stop step's boundary (every
    # second step) is handed back at the next one, as in the first run's step 3
    assert _resumed_partition(log) == _partitions(second[0][1])[stopped], log[-3000:]
    if stopped % 2 == 0:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            last = [r for r in map(json.loads, f) if r["kind"] == "step"][-1]
        assert last["reason"].startswith("evaluation over"), last
    assert _steps_written(out) == list(range(1, stopped + 2))


def test_sync_across_two_processes_rolls_out_each_hosts_share_then_trains_on_both(tmp_path):
    # Sync's rollout phase runs on both hosts at once; the batch waits until both phases are
    # over and holds each host's share (--quick: 2 groups, one per host).
    runs = _run(tmp_path, "sync", "none",
                _job_args(tmp_path / "run", steps=2, extra=["--system", "sync"]), processes=2)
    for code, log in runs:
        assert code == 0, log[-3000:]
    digests = [_digests(log) for _, log in runs]
    assert sorted(digests[0]) == [1, 2] and digests[0] == digests[1]
    for step, digest in digests[0].items():
        groups = digest.split("groups=")[1].split(",")
        assert sorted(g.startswith("p1.") for g in groups) == [False, True], digest
    for pid, (_, log) in enumerate(runs):
        assert re.findall(rf"sync v(\d+): \d+ rollout rank\(s\) on process {pid} hold",
                          log) == ["1", "2"]


def _log_time(line: str) -> datetime.datetime:
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


# Slow (about 80 s): the same failure is tested on the decisions alone in test_cluster.py.
@pytest.mark.slow
def test_a_desynchronised_control_loop_fails_within_a_minute_naming_the_stage(tmp_path):
    # Process 1 makes its own ERS plan instead of reading the leader's and goes on to the
    # weight sync; the leader waits at "plan" for process 1's digest. Neither enters the
    # sync's collective (where nothing would time out): both stop when the process timeout
    # (20 s) passes, each naming the stage it waited at.
    (code0, log0), (code1, log1) = _run(tmp_path, "skip", "skip",
                                        _job_args(tmp_path / "run", steps=2), processes=2,
                                        timeout_s=20)
    assert code0 == 4 and code1 == 4, (log0[-3000:], log1[-3000:])
    failed = [next(line for line in log.splitlines() if "run failed" in line)
              for log in (log0, log1)]
    assert re.search(r"waited 20 s at stage 'plan'", failed[0]), failed[0]
    assert re.search(r"waited 20 s at stage 'sync'", failed[1]), failed[1]
    assert (_log_time(failed[0]) - _log_time(failed[1])).total_seconds() < 60
