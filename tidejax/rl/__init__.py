"""The RL core: batches, GRPO advantages, losses, deferred-KL actor steps, trainer."""

from tidejax.rl.advantages import (
    compute_advantages,
    drgrpo_advantages,
    group_mean_std,
    grpo_advantages,
    nonzero_variance,
)
from tidejax.rl.batch import (
    Batch,
    Trajectory,
    build_batch,
    loss_denominator,
    num_sequences,
    segment_positions,
)
from tidejax.rl.config import AdvantageConfig, LossConfig, OptimConfig, RLConfig
from tidejax.rl.deferred import actor_backward, actor_forward, loss_cotangent, residual_bytes
from tidejax.rl.losses import aggregate, kl_penalty, policy_loss, rl_loss, sft_loss, token_weights
from tidejax.rl.state import (
    Accum,
    TrainState,
    add_to_accum,
    init_train_state,
    lr_schedule,
    make_optimizer,
    zero_accum,
)
from tidejax.rl.steps import (
    actor_grads,
    apply_update,
    fused_rl_loss,
    ref_logprobs,
    sft_grads,
    sft_step,
)
from tidejax.rl.trainer import Trainer, make_trainer

__all__ = [
    "Accum", "AdvantageConfig", "Batch", "LossConfig", "OptimConfig", "RLConfig", "TrainState",
    "Trainer", "Trajectory", "actor_backward", "actor_forward", "actor_grads", "add_to_accum",
    "aggregate", "apply_update", "build_batch", "compute_advantages", "drgrpo_advantages",
    "fused_rl_loss", "group_mean_std", "grpo_advantages", "init_train_state", "kl_penalty",
    "loss_cotangent", "loss_denominator", "lr_schedule", "make_optimizer", "make_trainer",
    "nonzero_variance", "num_sequences", "policy_loss", "ref_logprobs", "residual_bytes",
    "rl_loss", "segment_positions", "sft_grads", "sft_loss", "sft_step",
    "token_weights", "zero_accum",
]
