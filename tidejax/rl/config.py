"""Frozen, validated configs for the RL core: loss, advantages, optimizer, trainer."""

from __future__ import annotations

import dataclasses

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ADV_ESTIMATORS = ("grpo", "drgrpo")
OFF_POLICY_LOSSES = ("behaviour", "decoupled")


def _check(ok: bool, cls: str, field: str, value, want: str) -> None:
    if not ok:
        raise ValueError(f"{cls}.{field} must be {want}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Clipped policy loss for tokens from current or older weights, plus a KL to the reference.

    `clip_eps_high > clip_eps_low` is DAPO's clip-higher. `kl_coef = 0` disables the KL term
    (the reference model is then not needed at all). `off_policy = "behaviour"` clips the
    ratio to the behaviour policy (standard PPO); "decoupled" is AReaL's decoupled PPO (clip
    against the weights being trained, importance weight to the behaviour policy truncated
    at `is_weight_cap`). The two agree on-policy. With one optimizer update per batch, as
    here, the decoupled clip never binds: stale tokens keep their whole gradient, where the
    behaviour clip zeroes the tokens the policy has already moved. The default job uses
    "decoupled" (see `RunConfig.rl`); at twice its learning rate every system, sync
    included, diverged late in some seeds, so it wants a step size sync is stable at.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    off_policy: str = "behaviour"
    # 2.0: ms-swift's default truncation (rollout_importance_sampling_threshold) for
    # truncated importance sampling, Yao et al. 2025's fix for rollout/trainer mismatch.
    is_weight_cap: float = 2.0
    kl_coef: float = 0.04
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"

    def __post_init__(self):
        name = type(self).__name__
        _check(0 <= self.clip_eps_low < 1, name, "clip_eps_low", self.clip_eps_low, "in [0, 1)")
        _check(self.clip_eps_high >= 0, name, "clip_eps_high", self.clip_eps_high, ">= 0")
        _check(self.off_policy in OFF_POLICY_LOSSES, name, "off_policy", self.off_policy,
               f"one of {OFF_POLICY_LOSSES}")
        _check(self.is_weight_cap >= 1, name, "is_weight_cap", self.is_weight_cap, ">= 1")
        _check(self.kl_coef >= 0, name, "kl_coef", self.kl_coef, ">= 0")
        _check(self.kl_estimator in KL_ESTIMATORS, name, "kl_estimator", self.kl_estimator,
               f"one of {KL_ESTIMATORS}")
        _check(self.loss_agg in LOSS_AGGS, name, "loss_agg", self.loss_agg,
               f"one of {LOSS_AGGS}")

    def replace(self, **changes) -> LossConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Group-relative advantages. `drgrpo` drops the division by the group std (Dr. GRPO)."""

    estimator: str = "grpo"
    eps: float = 1e-6
    filter_zero_variance: bool = False
    zero_variance_tol: float = 1e-6

    def __post_init__(self):
        name = type(self).__name__
        _check(self.estimator in ADV_ESTIMATORS, name, "estimator", self.estimator,
               f"one of {ADV_ESTIMATORS}")
        _check(self.eps > 0, name, "eps", self.eps, "> 0")
        _check(self.zero_variance_tol >= 0, name, "zero_variance_tol", self.zero_variance_tol,
               ">= 0")

    def replace(self, **changes) -> AdvantageConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW behind global-norm clipping, with linear warmup then cosine decay.

    The learning rate rises from 0 to `lr` over `warmup_steps`, then follows a cosine to
    `lr * end_lr_ratio` at `total_steps`. Norms and biases are not weight-decayed.
    `total_steps = None` is for a job to fill in: the job's `RunConfig` sets it to the run's
    steps, so the schedule spans the run.
    """

    lr: float = 1e-6
    warmup_steps: int = 0
    total_steps: int | None = 1000
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        name = type(self).__name__
        _check(self.lr > 0, name, "lr", self.lr, "> 0")
        _check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, name,
               "warmup_steps", self.warmup_steps, "an int >= 0")
        _check(self.total_steps is None or (isinstance(self.total_steps, int)
                                            and self.total_steps > self.warmup_steps), name,
               "total_steps", self.total_steps,
               f"an int > warmup_steps ({self.warmup_steps}) or None (the run's steps)")
        _check(0 <= self.end_lr_ratio <= 1, name, "end_lr_ratio", self.end_lr_ratio, "in [0, 1]")
        _check(self.weight_decay >= 0, name, "weight_decay", self.weight_decay, ">= 0")
        _check(self.clip_norm > 0, name, "clip_norm", self.clip_norm, "> 0")
        _check(0 <= self.b1 < 1, name, "b1", self.b1, "in [0, 1)")
        _check(0 <= self.b2 < 1, name, "b2", self.b2, "in [0, 1)")
        _check(self.eps > 0, name, "eps", self.eps, "> 0")

    def replace(self, **changes) -> OptimConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Everything the trainer needs besides the model config and the mesh.

    `logprob_chunk` bounds the live `[B, chunk, V]` logits; `remat` recomputes each layer's
    activations in the backward pass (smaller residuals between actor forward and backward,
    about one extra forward of compute); None turns it on for models above
    `tidejax.rl.trainer.REMAT_ABOVE_PARAMS`. `temperature` is the rollout sampler's: the
    actor and reference log-probs are taken from `logits / temperature`, the distribution
    the behaviour log-probs came from, so importance ratios and the KL compare like with like.
    """

    loss: LossConfig = LossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    optim: OptimConfig = OptimConfig()
    logprob_chunk: int = 128
    remat: bool | None = None
    temperature: float = 1.0

    def __post_init__(self):
        name = type(self).__name__
        _check(isinstance(self.logprob_chunk, int) and self.logprob_chunk > 0, name,
               "logprob_chunk", self.logprob_chunk, "a positive int")
        _check(self.temperature > 0, name, "temperature", self.temperature, "> 0")
        for field, cls in (("loss", LossConfig), ("advantage", AdvantageConfig),
                           ("optim", OptimConfig)):
            value = getattr(self, field)
            _check(isinstance(value, cls), name, field, value, f"a {cls.__name__}")

    def replace(self, **changes) -> RLConfig:
        return dataclasses.replace(self, **changes)
