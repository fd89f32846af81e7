"""How the rollout manager schedules tasks onto rollout ranks (`RolloutConfig`).

A leaf, like the other components' configs: `tidejax.config.RunConfig` composes it, and
runtime's controller and job build on `RunConfig`, so it imports nothing from runtime.
"""

from __future__ import annotations

import dataclasses

# The orders the trainer may take finished groups in (runtime/buffer.py says what each does).
CONSUME_ORDERS = ("admission", "completion", "deadline")
DEFAULT_CONSUME_ORDER = "deadline"  # the runtime's and the simulator's (see RolloutConfig)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How tasks are scheduled onto rollout ranks."""

    scheduler: str = "ctb"  # "ctb" | "request"
    max_new_tokens: int = 32
    # The sampling temperature of training rollouts; the trainer takes its log-probs at the
    # same temperature (RunConfig.trainer_rl passes it on).
    temperature: float = 1.0
    # Evaluation samples at the training temperature by default (None): greedy decoding of
    # a small policy loops on one action, which measures the decoder, not what RL optimised.
    eval_temperature: float | None = None
    env_capacity: int = 64  # tasks the env cluster runs at once
    # Episodes open at once in the env pool (None: no cap beyond env_capacity's calls in
    # flight); for envs costly to keep open, e.g. one JVM each.
    env_max_open_episodes: int | None = None
    staleness_bound: int = 1  # versions; also the CTB/AReaL admission quota
    batch_groups: int = 4  # groups per trainer step (for the staleness quota)
    # The order the trainer takes finished groups in (see runtime/buffer.py): "deadline"
    # takes the oldest version first and the fastest within it, keeping a place in the
    # batch for every running group that would go stale, so none is dropped; "admission"
    # waits for the oldest admitted group (the default until bench.learning found the two
    # learn alike, 2026-12-07); "completion" (fastest first, stale groups dropped) is the
    # ablation.
    consume_order: str = DEFAULT_CONSUME_ORDER
    budget_fraction: float = 0.9  # share of a rank's KV pool CTB may plan with
    max_task_attempts: int = 2  # env failures: restart a task this many times in total
    retry_backoff_s: float = 0.05
    probe_default_tokens: int = 512
    # Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): a training group whose rewards
    # are all equal has zero GRPO advantage, so it is dropped before the buffer and its
    # staleness-quota slot admits a new group. At most `dynamic_sampling_rounds` batches'
    # worth of groups are sampled per trainer step; past that, such groups train as usual
    # (a policy that always scores the same must not stall the trainer).
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = 4

    @property
    def evaluation_temperature(self) -> float:
        return self.temperature if self.eval_temperature is None else self.eval_temperature

    def __post_init__(self):
        if self.consume_order not in CONSUME_ORDERS:
            raise ValueError(f"RolloutConfig.consume_order must be one of {CONSUME_ORDERS}, "
                             f"got {self.consume_order!r}")
        if self.scheduler not in ("ctb", "request"):
            raise ValueError(f"RolloutConfig.scheduler must be 'ctb' or 'request', "
                             f"got {self.scheduler!r}")
        for name in ("max_new_tokens", "env_capacity", "batch_groups", "max_task_attempts",
                     "probe_default_tokens", "dynamic_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.env_max_open_episodes is not None and self.env_max_open_episodes < 1:
            raise ValueError(f"RolloutConfig.env_max_open_episodes must be >= 1 or unset, "
                             f"got {self.env_max_open_episodes}")
        if self.staleness_bound < 0:
            raise ValueError(f"RolloutConfig.staleness_bound must be >= 0, "
                             f"got {self.staleness_bound}")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"RolloutConfig.budget_fraction must be in (0, 1], "
                             f"got {self.budget_fraction}")
        for name in ("temperature", "eval_temperature"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"RolloutConfig.{name} must be >= 0, got {getattr(self, name)}")
