"""The memory model: exact parts against the real parameter trees, divisibility, the
layouts it admits, and ERS staying inside them (pure; the calibration against compiled
steps is in tests/sched/test_memory_calibration.py)."""

import random

import pytest

from tidejax.models.config import get_preset
from tidejax.models.model import abstract_params, param_count
from tidejax.sched import ers, memory
from tidejax.sched.ra2p import Ra2pCosts

PRESETS = ("tiny", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b")


@pytest.mark.parametrize("preset", PRESETS)
def test_parameter_count_is_the_models(preset):
    config = get_preset(preset)
    assert memory.ModelShape.of(config).params == param_count(abstract_params(config))


def test_kv_bytes_match_the_model_config():
    config = get_preset("qwen2.5-14b")
    assert memory.ModelShape.of(config).kv_bytes_per_token() == config.kv_bytes_per_token(2)


def test_undivided_names_the_dimension():
    shape = memory.ModelShape.of(get_preset("qwen2.5-7b"))  # hidden 3584 = 2^9 * 7
    assert [n for n in range(1, 9) if not memory.undivided(shape, trainer_devices=n)] == [
        1, 2, 4, 7, 8]
    assert "hidden_size 3584 over 6" in memory.undivided(shape, trainer_devices=6)[0]
    # 28 heads and 4 KV heads: a 3-device rollout rank splits neither
    bad = memory.undivided(shape, tensor=3)
    assert any("num_heads" in b for b in bad) and any("num_kv_heads" in b for b in bad)
    assert not memory.undivided(shape, tensor=4)


def test_storage_dim_pads_within_the_cap_and_keeps_every_dividing_size():
    # 14B: 5,120 divides 1, 2, 4, 5, 8; 5,160 (+0.8%) also divides 3 and 6
    assert memory.storage_dim(5120, range(1, 9)) == 5160
    # 7B: keeping 7 and 8 and adding 3 needs a multiple of 168 (3,696, +3.1%): no padding
    assert memory.storage_dim(3584, range(1, 9)) == 3584
    assert memory.storage_dim(3584, range(1, 9), max_padding=0.05) == 3696
    assert memory.storage_dim(64, (1, 2, 4, 8)) == 64  # divides them all already
    padded = memory.ModelShape.of(get_preset("qwen2.5-14b"))
    padded = memory.replace(padded, stored_d_model=5160)
    assert not memory.undivided(padded, trainer_devices=6)
    assert "stored as 5160" in memory.undivided(padded, trainer_devices=7)[0]
    # the stored state is the padded tree's, slightly above the model's
    assert padded.params < padded.stored_params < 1.01 * padded.params


def test_the_reference_stays_beside_the_actor_only_where_it_fits():
    jm = _job("qwen2.5-7b", 60)
    ref = jm.shape.compute_bytes * jm.shape.stored_params / 4
    assert jm.ref_stays_beside(4)
    tight = memory.replace(jm, capacity_bytes=jm.actor(4).total + ref - 1)
    assert not tight.ref_stays_beside(4)
    unknown = memory.replace(jm, capacity_bytes=memory.UNBOUNDED_BYTES)  # CPU
    assert not unknown.ref_stays_beside(4)


def test_attention_constants_match_the_model():
    from tidejax.models import model

    assert memory.ATTENTION_BLOCK == model.ATTENTION_BLOCK
    assert memory.ATTENTION_LOOP_FROM == model.ATTENTION_LOOP_FROM


def _job(preset, capacity_gib, micro_batch_tokens=16384, row_len=4096, pages=8192):
    engine = memory.EngineShape(num_pages=pages, page_size=16, max_slots=64,
                                max_seq_len=row_len, prefill_chunk=1024)
    return memory.JobMemory(memory.ModelShape.of(get_preset(preset)), micro_batch_tokens,
                            row_len, True, engine, capacity_gib * memory.GIB)


def test_state_bytes_are_exact_and_shrink_with_devices():
    jm = _job("qwen2.5-7b", 60)
    params = jm.shape.params
    four = memory.trainer_step(jm.shape, 4, jm.batch(4), "fused").by_kind
    assert four["params"] == 4 * params / 4 and four["optimizer"] == 8 * params / 4
    assert four["grads"] == 4 * params / 4
    assert jm.actor(8).total < jm.actor(4).total


def test_admitted_partitions_divide_and_fit():
    jm = _job("qwen2.5-7b", 60)
    partitions = jm.partitions(8)
    assert partitions
    for rollout, ref, actor in partitions:
        assert rollout >= 1 and rollout + ref + actor == 8
        assert not jm.problems(rollout, actor, ref)
        assert jm.actor(actor).total <= jm.capacity_bytes
    assert all(a not in (3, 5, 6) for _, _, a in partitions)
    # a small device admits fewer actor meshes; none at all when nothing fits
    assert set(_job("qwen2.5-7b", 30).actor_sizes(7)) < set(jm.actor_sizes(7))
    assert _job("qwen2.5-7b", 10).partitions(8) == []


def test_problems_say_which_role_and_how_much():
    jm = _job("qwen2.5-7b", 60)
    problems = jm.problems(rollout_ranks=7, actor_devices=1)
    assert problems and problems[0].startswith("actor on 1 device(s) needs")
    assert "over 60.0 GiB" in problems[0]
    assert jm.problems(2, 6)[0].startswith("actor: hidden_size 3584 over 6")


def test_ers_only_chooses_admitted_sizes():
    """Random readiness signals over many boundaries: every partition ERS returns keeps
    the actor and reference meshes at admitted sizes and the cluster size fixed."""
    sizes = (2, 4, 7)
    cfg = ers.ErsConfig(b_min=2, b_ideal=8, actor_sizes=sizes, ref_sizes=(1, 2))
    rng = random.Random(0)
    p = ers.initial(8, cfg)
    assert p == ers.Partition(rollout=6, actor=2)
    seen = set()
    for i in range(400):
        costs = Ra2pCosts(w_act=rng.uniform(0.1, 2), w_ref=rng.uniform(0.05, 1),
                          t_swap=rng.uniform(0, 1), n_actor=p.actor, n_ref=p.ref)
        signals = ers.Signals(
            ras_mb=rng.randint(0, 20), ready_groups=rng.randint(0, 16),
            tprm_s=rng.uniform(0.01, 5), hol_s=rng.uniform(0, 10), t_step_s=10.0,
            mb_per_step=rng.randint(1, 8), costs=costs, prev_batch=8,
            twt_frac=rng.choice([0.0, 0.05, 0.5, 0.9]),
            rollout_idle_frac=rng.choice([0.0, 0.05, 0.5]), last_step_s=10.0,
            last_pressure=rng.choice([-1, 0, 1]), since_move=rng.randint(0, 5),
            eval_phase=rng.random() < 0.05,
            eval_ranks_out=rng.choice([0, 0, 1]))
        p = ers.plan(signals, p, cfg).partition
        assert p.total == 8 and p.rollout >= 1
        assert p.actor in sizes and p.ref in (0, 1, 2)
        seen.add(p)
    assert len({q.actor for q in seen}) > 1  # it did move, between admitted sizes only


def test_next_size_without_bounds_moves_one_rank():
    cfg = ers.ErsConfig(b_min=1, b_ideal=4)
    assert cfg.actor_size(3, grow=True) == 4 and cfg.actor_size(1, grow=False) is None
    assert cfg.ref_size(2, grow=False) == 1 and cfg.ref_size(1, grow=False) == 0
