"""One process of the multi-process job tests in test_multiprocess_job.py (not collected).

    python job_worker.py HOOK WEBSHOP_ARGS...

HOOK: "none"; "move" (ERS's first plan after the cold start moves one rank from rollout
to the actor, so the actor mesh changes size across both processes); "skip" (process 1
makes its own plan without the leader's decision: a desynchronised control loop).
"""

import dataclasses
import sys

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(4)

from tidejax.experiments import webshop
from tidejax.runtime import controller as controller_module
from tidejax.sched import ers


def force_one_move() -> None:
    plan = controller_module.Controller._plan
    moved = []

    def plan_with_a_move(self, *args, **kwargs):
        result = plan(self, *args, **kwargs)
        p = result.partition
        if not moved and p.rollout > 1:
            moved.append(True)
            return dataclasses.replace(result, reason="forced move (test)",
                                       partition=ers.Partition(rollout=p.rollout - 1,
                                                               actor=p.actor + 1, ref=p.ref))
        return result

    controller_module.Controller._plan = plan_with_a_move


def skip_the_plan_decision_on_process_1() -> None:
    agreed = controller_module.Controller._agreed_plan

    def plan(self, *args):
        if self.process == 1:  # from its own signals only, without asking the leader
            return self._plan(self._rollout_digest(), *args)
        return agreed(self, *args)

    controller_module.Controller._agreed_plan = plan


HOOKS = {"none": lambda: None, "move": force_one_move,
         "skip": skip_the_plan_decision_on_process_1}


def main() -> None:
    HOOKS[sys.argv[1]]()
    webshop.main(sys.argv[2:])


if __name__ == "__main__":
    main()
