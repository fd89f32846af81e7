"""RL math against numbers derived by hand (derivations in the comments)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tidejax.rl import (
    AdvantageConfig,
    Batch,
    LossConfig,
    OptimConfig,
    RLConfig,
    Trajectory,
    aggregate,
    build_batch,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    kl_penalty,
    loss_denominator,
    lr_schedule,
    make_optimizer,
    num_sequences,
    policy_loss,
    rl_loss,
    segment_positions,
    sft_loss,
)

LN2 = math.log(2.0)

# Groups: 0 -> rewards [1, 0, 0, 1]: mean 0.5, population var 4 * 0.25 / 4 = 0.25, std 0.5.
#         1 -> [2, 2]: std 0.        2 -> [5]: a group of one, std 0.
#         3 -> [0, 3, 3]: mean 2, deviations [-2, 1, 1], var (4 + 1 + 1) / 3 = 2, std sqrt(2).
REWARDS = [1, 0, 0, 1, 2, 2, 5, 0, 3, 3]
GROUPS = [0, 0, 0, 0, 1, 1, 2, 3, 3, 3]


def test_grpo_advantages_by_hand():
    eps = 1e-6
    adv = jax.jit(grpo_advantages, static_argnums=2)(jnp.array(REWARDS), jnp.array(GROUPS), eps)
    # (r - mean) / (std + eps): group 0 -> +-0.5 / 0.5 = +-1; zero-std groups -> 0 / eps = 0;
    # group 3 -> [-2, 1, 1] / sqrt(2) = [-1.41421, 0.70711, 0.70711].
    s = 0.5 / (0.5 + eps)
    r2 = math.sqrt(2.0)
    want = [s, -s, -s, s, 0, 0, 0, -2 / (r2 + eps), 1 / (r2 + eps), 1 / (r2 + eps)]
    chex.assert_trees_all_close(adv, jnp.array(want), atol=1e-6)


def test_drgrpo_advantages_by_hand():
    # r - mean, no std: group 0 -> +-0.5, group 3 -> [-2, 1, 1].
    want = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, -2, 1, 1]
    chex.assert_trees_all_close(drgrpo_advantages(REWARDS, GROUPS), jnp.array(want, jnp.float32))


def test_zero_variance_groups_are_filtered():
    adv, keep = compute_advantages(REWARDS, GROUPS, AdvantageConfig(filter_zero_variance=True))
    assert float(adv[4]) == 0.0  # a filtered group's advantage is 0 anyway
    # Groups 1 and 2 have std 0 and carry no signal.
    np.testing.assert_array_equal(keep, [1, 1, 1, 1, 0, 0, 0, 1, 1, 1])
    _, keep_all = compute_advantages(REWARDS, GROUPS, AdvantageConfig(estimator="drgrpo"))
    assert bool(keep_all.all())
    # Group ids need not be contiguous or sorted.
    chex.assert_trees_all_close(grpo_advantages([3.0, 1.0, 7.0], [9, -4, 9]),
                                jnp.array([-1.0, 0.0, 1.0]), atol=1e-5)


def test_kl_estimators_by_hand():
    # Token 1: p = 0.5, p_ref = 0.25 -> log_r = log(p_ref / p) = -ln2.
    # Token 2: p = 0.2, p_ref = 0.4  -> log_r = +ln2.
    logp = jnp.log(jnp.array([0.5, 0.2]))
    ref = jnp.log(jnp.array([0.25, 0.4]))
    # k1 = -log_r = [ln2, -ln2]; k2 = log_r^2 / 2 = ln2^2 / 2 = 0.240227 for both;
    # k3 = e^log_r - 1 - log_r: [0.5 - 1 + ln2, 2 - 1 - ln2] = [0.193147, 0.306853].
    want = {"k1": [LN2, -LN2], "k2": [LN2**2 / 2] * 2, "k3": [LN2 - 0.5, 1 - LN2]}
    # d/dlogp: k1 -> 1; k2 -> -log_r = [ln2, -ln2]; k3 -> 1 - e^log_r = [0.5, -1].
    grads = {"k1": [1, 1], "k2": [LN2, -LN2], "k3": [0.5, -1.0]}
    for name in ("k1", "k2", "k3"):
        value, g = jax.jit(jax.vmap(jax.value_and_grad(
            lambda lp, r, n=name: kl_penalty(lp, r, n))))(logp, ref)
        chex.assert_trees_all_close(value, jnp.array(want[name]), atol=1e-6)
        chex.assert_trees_all_close(g, jnp.array(grads[name], jnp.float32), atol=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_clipped_policy_loss_by_hand():
    # eps = 0.2: the ratio is clipped to [0.8, 1.2]; loss = -min(r A, clip(r) A).
    ratio = jnp.array([1.5, 1.5, 0.5, 0.5, 1.0])
    adv = jnp.array([1.0, -1.0, 1.0, -1.0, 2.0])
    behaviour = jnp.full(5, -3.0)
    logp = behaviour + jnp.log(ratio)
    # r=1.5, A=+1: min(1.5, 1.2) = 1.2 -> -1.2, clipped, zero gradient.
    # r=1.5, A=-1: min(-1.5, -1.2) = -1.5 -> 1.5, unclipped, d/dlogp = -A r = 1.5.
    # r=0.5, A=+1: min(0.5, 0.8) = 0.5 -> -0.5, unclipped, d/dlogp = -0.5.
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> 0.8, clipped, zero gradient.
    # r=1.0, A=2:  -2, unclipped, d/dlogp = -2.
    loss, clipped, truncated = jax.jit(policy_loss, static_argnums=(3, 4))(
        logp, behaviour, adv, 0.2, 0.2)
    chex.assert_trees_all_close(loss, jnp.array([-1.2, 1.5, -0.5, 0.8, -2.0]), atol=1e-5)
    np.testing.assert_array_equal(clipped, [True, False, False, True, False])
    assert not truncated.any()
    g = jax.jit(jax.grad(lambda lp: policy_loss(lp, behaviour, adv, 0.2, 0.2)[0].sum()))(logp)
    chex.assert_trees_all_close(g, jnp.array([0.0, 1.5, -0.5, 0.0, -2.0]), atol=1e-5)
    # Clip-higher (eps_high = 0.28): r = 1.25, A = 1 stays below 1.28 -> -1.25, unclipped.
    loss, clipped, _ = policy_loss(jnp.log(jnp.array([1.25])), jnp.zeros(1), jnp.ones(1), 0.2,
                                   0.28)
    chex.assert_trees_all_close(loss, jnp.array([-1.25]), atol=1e-6)
    assert not bool(clipped[0])


def test_decoupled_policy_loss_by_hand():
    # Decoupled PPO with the proximal policy = the weights being differentiated: the clip
    # ratio is 1 at the current weights, so nothing is clipped, and each token's gradient is
    # -A * w with w = pi/pi_behaviour truncated at 2. The same tokens under the behaviour
    # clip (first test) lose the gradient of the tokens whose ratio left [0.8, 1.2].
    ratio = jnp.array([1.5, 1.5, 0.5, 0.5, 1.0, 3.0])
    adv = jnp.array([1.0, -1.0, 1.0, -1.0, 2.0, 1.0])
    behaviour = jnp.full(6, -3.0)
    logp = behaviour + jnp.log(ratio)

    def decoupled(lp):
        return policy_loss(lp, behaviour, adv, 0.2, 0.2, proximal_logp_BT=lp, is_weight_cap=2.0)

    loss, clipped, truncated = jax.jit(decoupled)(logp)
    # Values: -w * A with w = [1.5, 1.5, 0.5, 0.5, 1, min(3, 2)].
    chex.assert_trees_all_close(loss, jnp.array([-1.5, 1.5, -0.5, 0.5, -2.0, -2.0]), atol=1e-5)
    assert not clipped.any()
    np.testing.assert_array_equal(truncated, [False] * 5 + [True])
    g = jax.jit(jax.grad(lambda lp: decoupled(lp)[0].sum()))(logp)
    chex.assert_trees_all_close(g, jnp.array([-1.5, 1.5, -0.5, 0.5, -2.0, -2.0]), atol=1e-5)
    # On-policy tokens (behaviour = current) give the behaviour clip's loss and gradient.
    on_loss, _, _ = policy_loss(behaviour, behaviour, adv, 0.2, 0.2, behaviour)
    chex.assert_trees_all_close(on_loss, policy_loss(behaviour, behaviour, adv, 0.2, 0.2)[0])


def test_rl_loss_chooses_the_off_policy_correction():
    behaviour_logp = jnp.full((1, 3), -2.0)
    batch = _batch(behaviour_logp, jnp.array([[1.0, 1.0, -1.0]]))
    logp = behaviour_logp + jnp.log(jnp.array([[1.0, 1.5, 0.5]]))
    grad = jax.jit(jax.grad(lambda lp, c: rl_loss(lp, None, batch, c)[0]), static_argnums=1)
    behaviour = grad(logp, LossConfig(kl_coef=0.0, off_policy="behaviour"))
    decoupled = grad(logp, LossConfig(kl_coef=0.0, off_policy="decoupled"))
    # Both loss tokens left [0.8, 1.2] in the advantage's direction: the behaviour clip
    # zeroes their gradients; the decoupled loss gives -w A / 2 (two loss tokens).
    chex.assert_trees_all_close(behaviour, jnp.zeros((1, 3)), atol=1e-6)
    chex.assert_trees_all_close(decoupled, jnp.array([[0.0, -0.75, 0.25]]), atol=1e-6)
    _, metrics = rl_loss(logp, None, batch, LossConfig(kl_coef=0.0, off_policy="behaviour"))
    assert float(metrics["clipped"]) == 2.0 and float(metrics["truncated"]) == 0.0
    with pytest.raises(ValueError, match="off_policy"):
        LossConfig(off_policy="ppo")
    with pytest.raises(ValueError, match="is_weight_cap"):
        LossConfig(is_weight_cap=0.5)


# Row 0 packs two sequences (segments 1, 2); row 1 one sequence and a padding token.
SEG = jnp.array([[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])
MASK = jnp.array([[0, 1, 1, 0, 1], [0, 1, 1, 1, 0]], jnp.float32)
VALUES = jnp.array([[9, 1, 2, 9, 3], [9, 4, 5, 6, 9]], jnp.float32)


def test_loss_aggregation_by_hand():
    # Masked values: seq (0,1) -> [1, 2], seq (0,2) -> [3], seq (1,1) -> [4, 5, 6].
    # token-mean: (1+2+3+4+5+6) / 6 = 21 / 6 = 3.5.
    # seq-mean-token-sum: sums [3, 3, 15] -> 21 / 3 = 7.
    # seq-mean-token-mean: means [1.5, 3, 5] -> 9.5 / 3 = 3.16667.
    want = {"token-mean": 3.5, "seq-mean-token-sum": 7.0, "seq-mean-token-mean": 9.5 / 3}
    agg = jax.jit(aggregate, static_argnums=(3,))
    for mode, value in want.items():
        np.testing.assert_allclose(agg(VALUES, MASK, SEG, mode), value, rtol=1e-6)
    # A global normaliser of 10 (the whole step): 21/10, 21/10, 9.5/10.
    want10 = {"token-mean": 2.1, "seq-mean-token-sum": 2.1, "seq-mean-token-mean": 0.95}
    for mode, value in want10.items():
        np.testing.assert_allclose(agg(VALUES, MASK, SEG, mode, 10.0), value, rtol=1e-6)
    assert float(num_sequences(MASK, SEG)) == 3


def _batch(logp_behaviour, adv):
    one = jnp.ones((1, 3), jnp.int32)
    return Batch(tokens=one, positions=jnp.arange(3)[None], segment_ids=one,
                 loss_mask=jnp.array([[0.0, 1.0, 1.0]]), behaviour_logp=logp_behaviour,
                 policy_version=jnp.zeros((1, 3), jnp.int32), advantages=adv)


def test_rl_loss_adds_the_kl_term_by_hand():
    logp = jnp.log(jnp.array([[1.0, 0.5, 0.2]]))
    ref = jnp.log(jnp.array([[1.0, 0.25, 0.4]]))
    batch = _batch(logp, jnp.ones((1, 3)))
    # Ratio 1 everywhere, A = 1 -> pg per token -1, token-mean -1.
    # k3 on tokens 1, 2 = [ln2 - 0.5, 1 - ln2] -> mean 0.25; loss = -1 + 0.1 * 0.25 = -0.975.
    loss, m = jax.jit(rl_loss, static_argnums=(3,))(logp, ref, batch, LossConfig(kl_coef=0.1))
    np.testing.assert_allclose([loss, m["pg_loss"], m["kl"], m["clipped"], m["tokens"]],
                               [-0.975, -1.0, 0.25, 0.0, 2.0], rtol=1e-5)
    loss0, _ = rl_loss(logp, None, batch, LossConfig(kl_coef=0.0))
    np.testing.assert_allclose(loss0, -1.0, rtol=1e-6)


def test_sft_loss_by_hand():
    logp = jnp.log(jnp.array([[1.0, 0.5, 0.25]]))
    batch = Batch.for_sft(np.ones((1, 3)), np.array([[0, 1, 1]]))
    # -(ln 0.5 + ln 0.25) / 2 = (ln2 + 2 ln2) / 2 = 1.5 ln2 = 1.039721.
    loss, m = sft_loss(logp, batch)
    np.testing.assert_allclose(loss, 1.5 * LN2, rtol=1e-6)
    assert float(m["tokens"]) == 2


def test_build_batch_packs_rows_by_hand():
    def traj(n, gen, group):
        mask = np.array([0] * (n - gen) + [1] * gen, np.float32)
        return Trajectory(tokens=np.arange(10, 10 + n), loss_mask=mask,
                          behaviour_logp=-mask, policy_version=np.full(n, 3),
                          reward=1.0, group_id=group)

    trajs = [traj(3, 2, 0), traj(4, 3, 1), traj(2, 1, 0)]
    b = build_batch(trajs, [0.5, -1.0, 2.0], rows=[[0, 2], [1], []], row_len=5)
    np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0], [0] * 5])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0], [0] * 5])
    np.testing.assert_array_equal(segment_positions(b.segment_ids), b.positions)
    np.testing.assert_array_equal(b.tokens[0], [10, 11, 12, 10, 11])
    np.testing.assert_array_equal(b.loss_mask, [[0, 1, 1, 0, 1], [0, 1, 1, 1, 0], [0] * 5])
    np.testing.assert_array_equal(b.advantages[0], [0.5, 0.5, 0.5, 2.0, 2.0])
    np.testing.assert_array_equal(b.advantages[1], [-1.0, -1.0, -1.0, -1.0, 0.0])
    # 6 generated tokens; 3 sequences.
    assert loss_denominator([b], "token-mean") == 6
    assert loss_denominator([b], "seq-mean-token-sum") == 3
    with pytest.raises(ValueError, match="row_len"):
        build_batch(trajs, [0, 0, 0], rows=[[0, 1]], row_len=5)
    with pytest.raises(ValueError, match="loss_mask"):
        Trajectory(tokens=np.arange(2), loss_mask=np.ones(2), behaviour_logp=np.zeros(2),
                   policy_version=np.zeros(2), reward=0.0, group_id=0)


def test_lr_schedule_by_hand():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, total_steps=110, end_lr_ratio=0.1)
    sched = lr_schedule(cfg)
    # Warmup: 0 -> 1e-3 linearly over 10 steps (step 5 -> 5e-4). Cosine over the next 100
    # steps from 1e-3 to 1e-4: halfway (step 60) -> 1e-4 + 9e-4 * (1 + cos(pi/2)) / 2 = 5.5e-4.
    for step, want in [(0, 0.0), (5, 5e-4), (10, 1e-3), (60, 5.5e-4), (110, 1e-4)]:
        np.testing.assert_allclose(sched(step), want, rtol=1e-5, atol=1e-9)


def test_adamw_decays_kernels_but_not_norms_or_biases():
    cfg = OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    params = {"kernel": jnp.ones((2, 2)), "input_norm": {"scale": jnp.ones((2, 2))},
              "q_bias": jnp.ones(2)}
    tx = make_optimizer(cfg)

    @jax.jit
    def step(p):
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)
        return optax.apply_updates(p, updates)

    new = step(params)
    # Zero gradient: Adam's term is 0, decoupled decay gives p - lr * wd * p = 1 - 0.05.
    chex.assert_trees_all_close(new, {"kernel": jnp.full((2, 2), 0.95),
                                      "input_norm": {"scale": jnp.ones((2, 2))},
                                      "q_bias": jnp.ones(2)})


@pytest.mark.parametrize("make, field", [
    (lambda: LossConfig(kl_estimator="k4"), "kl_estimator"),
    (lambda: LossConfig(loss_agg="sum"), "loss_agg"),
    (lambda: LossConfig(clip_eps_low=1.5), "clip_eps_low"),
    (lambda: LossConfig(kl_coef=-1), "kl_coef"),
    (lambda: AdvantageConfig(estimator="ppo"), "estimator"),
    (lambda: OptimConfig(warmup_steps=10, total_steps=5), "total_steps"),
    (lambda: OptimConfig(lr=0), "lr"),
    (lambda: RLConfig(logprob_chunk=0), "logprob_chunk"),
])
def test_config_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()

