"""The runtime's ERS signals: the controller tells `ers.plan` about its evaluations, so the
evaluation's rank loan and the settling after it happen on the job as in the simulator."""

import types

from tidejax.config import RunConfig
from tidejax.runtime import controller as controller_module
from tidejax.runtime.controller import NO_ARRIVALS_S, Controller, _Batch, _Loop
from tidejax.runtime.trainer_runner import StepReport
from tidejax.sched import ers, ra2p


def planning_controller(eval_every: int):
    """The state `Controller._plan` reads, without devices, engines or a model."""
    fake = types.SimpleNamespace(
        cfg=RunConfig(eval_every=eval_every), records=[], _step_times=[10.0],
        _since_move=1 << 30, _move_s=0.0,
        ers_config=ers.ErsConfig(b_min=1, b_ideal=4, actor_sizes=(1, 2, 3, 4)))
    fake._evaluates_after = lambda step: Controller._evaluates_after(fake, step)
    return fake


def test_an_evaluation_borrows_a_trainer_rank_and_the_plans_after_it_settle():
    fake = planning_controller(eval_every=4)
    start = ers.Partition(rollout=4, actor=4)
    loop = _Loop(state=None, partition=start, completed=0,
                 plan=ers.Plan(start, ra2p.Mode.COLOCATED, 4, False, "initial"))
    report = StepReport(mode="colocated", micro_batches=4, sequences=16, tokens=4096,
                        generated_tokens=1024, seconds=10.0, ref_seconds=2.0,
                        swap_seconds=0.5, metrics={})
    batch = _Batch(groups=[None] * 4, local_groups=4, twt_s=0.0, filtered=0)
    rollout = {"ready_tokens": 0, "ready_groups": 0, "tprm_s": NO_ARRIVALS_S, "hol_s": 0.0,
               "dropped_groups": 0, "idle_frac": 0.0}
    seen = []
    for completed in range(1, 10):
        loop.completed = completed
        loop.plan = Controller._plan(fake, rollout, loop, report, 10.0, batch)
        loop.partition = loop.plan.partition
        seen.append((completed, loop.partition.rollout, loop.plan.eval_ranks_out,
                     loop.plan.reason))
    lend, back, *after = seen[3:]
    # boundary 4 queues the evaluation: a trainer rank serves it for one step
    assert lend[:3] == (4, 5, 1) and lend[3].startswith("preemptive generation"), seen
    assert back[:3] == (5, 4, 0) and back[3].startswith("evaluation over"), seen
    # the window of the last `cooldown` steps holds the evaluation's step (5) or the
    # refill after it (6) through boundary 4 + cooldown + 1
    cooldown = fake.ers_config.cooldown
    reasons = [s[3] for s in after]
    assert reasons[:cooldown] == ["evaluation: signals settling"] * cooldown, seen
    assert reasons[cooldown] != "evaluation: signals settling", seen
    assert controller_module.plan_from_json(
        controller_module.plan_to_json(loop.plan)) == loop.plan


def test_no_evaluation_no_loan():
    fake = planning_controller(eval_every=0)
    assert not any(Controller._evaluates_after(fake, step) for step in range(1, 10))
    every_third = planning_controller(eval_every=3)
    assert [Controller._evaluates_after(every_third, s) for s in range(1, 7)] == [
        False, False, True, False, False, True]
