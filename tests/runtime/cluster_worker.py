"""One process of the two-process tests in test_cluster.py (not collected by pytest).

    python cluster_worker.py PORT PROCESS_ID SCENARIO TIMEOUT_S

Scenarios: "agree" (leader decisions), "skip" (process 1 skips a decision). Prints one
JSON line of what it saw; a StageError is printed to stderr, exit code 3.
"""

import json
import sys

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(4)

import jax

from tidejax.runtime.cluster import Decisions, Launch, StageError, exit_now


def decisions_scenario(scenario: str, timeout_s: int) -> dict:
    decisions = Decisions(run_id="test", timeout_s=timeout_s)
    seen = {}
    try:
        # The leader's value wins: each process would compute its own pid here.
        if not (scenario == "skip" and jax.process_index() == 1):
            seen["plan"] = decisions.decide("plan", lambda: {"from": jax.process_index()})
        decisions.barrier("train")
        seen["ready"] = decisions.decide_from(
            "ready", {"ready": 2 + jax.process_index()},
            lambda digests: [d["ready"] for d in digests])
        seen["batch"] = decisions.decide("batch", lambda: [3, 1, 2])
    except StageError as e:
        print(f"StageError: {e}", file=sys.stderr, flush=True)
        exit_now(3)
    return seen


def main() -> None:
    port, process_id, scenario, timeout_s = sys.argv[1:5]
    process_id, timeout_s = int(process_id), int(timeout_s)
    Launch(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
           timeout_s=timeout_s).initialize()
    seen = {"process": jax.process_index(), "processes": jax.process_count(),
            "local_devices": jax.local_device_count(), "devices": jax.device_count()}
    seen.update(decisions_scenario(scenario, timeout_s))
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
