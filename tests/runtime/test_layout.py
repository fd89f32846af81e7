"""The job refuses, at start and naming the field, a layout that does not divide the model
or does not fit; what it admits is what ERS may choose; SFT picks a mesh that fits."""

import dataclasses
import os
import subprocess
import sys

import pytest

from tidejax.config import RunConfig, TopologyConfig
from tidejax.models.config import get_preset
from tidejax.runtime import layout
from tidejax.runtime.job import model_config_of
from tidejax.runtime.sft import sft_mesh_size
from tidejax.sched import memory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jm(cfg, devices=8):
    capacity = (cfg.memory_fraction * cfg.device_memory_gib * memory.GIB
                if cfg.device_memory_gib else memory.UNBOUNDED_BYTES)
    return layout.job_memory(cfg, model_config_of(cfg), capacity)


def test_an_undivided_actor_mesh_is_refused_naming_the_field():
    # tiny's hidden size 64 does not divide a 3-device actor mesh (4 devices, 1 rollout)
    cfg = RunConfig(system="async", topology=TopologyConfig(devices=4, rollout_ranks=1))
    with pytest.raises(layout.LayoutError, match=r"topology.rollout_ranks.*hidden_size 64 "
                                                 r"over 3 trainer devices"):
        layout.initial_partition(cfg, _jm(cfg, 4), 4)
    ok = RunConfig(system="async", topology=TopologyConfig(devices=4, rollout_ranks=2))
    assert layout.initial_partition(ok, _jm(ok, 4), 4).actor == 2


def test_a_7b_actor_on_one_80gb_device_is_refused_with_its_bytes():
    cfg = RunConfig(system="async", preset="qwen2.5-7b", model_vocab_size=None,
                    device_memory_gib=80.0, row_len=1536,
                    topology=TopologyConfig(devices=8, rollout_ranks=7))
    with pytest.raises(layout.LayoutError, match=r"actor on 1 device\(s\) needs [\d.]+ GiB "
                                                 r"\(params .*\) per device, over 60.0 GiB"):
        layout.initial_partition(cfg, _jm(cfg), 8)


def test_tide_starts_from_the_planned_split_at_an_admitted_actor_size():
    """Tide starts where the fixed splits run (`topology.rollout_ranks`), its actor rounded
    down to a mesh size ERS may choose; ERS moves from there."""
    for rollout_ranks, actor in ((4, 4), (3, 4), (5, 2), (7, 1)):  # tiny admits 1, 2, 4
        topology = TopologyConfig(devices=8, rollout_ranks=rollout_ranks)
        cfg = RunConfig(topology=topology)
        assert layout.ers_config(cfg, _jm(cfg), 8).actor_sizes == (1, 2, 4)
        assert layout.initial_partition(cfg, _jm(cfg), 8) == layout.ers.Partition(8 - actor,
                                                                                  actor)
    fixed = RunConfig(system="async")
    assert (layout.initial_partition(RunConfig(), _jm(fixed), 8)
            == layout.initial_partition(fixed, _jm(fixed), 8))
    big = RunConfig(preset="qwen2.5-7b", model_vocab_size=None, device_memory_gib=80.0,
                    row_len=1536, topology=TopologyConfig(devices=8, rollout_ranks=7))
    jm = _jm(big)
    bounds = layout.ers_config(big, jm, 8)
    assert bounds.actor_sizes and all(not memory.undivided(jm.shape, n)
                                      for n in bounds.actor_sizes)
    assert 1 not in bounds.actor_sizes  # 7B's state alone is 114 GiB on one device
    # one actor device is not admitted: the smallest admitted mesh, taken from rollout
    first = layout.initial_partition(big, jm, 8)
    assert first.actor == min(bounds.actor_sizes) and first.rollout == 8 - first.actor


def test_cpu_runs_check_divisibility_only():
    cfg = RunConfig()  # tiny on fake CPU devices: no memory is reported
    jm = _jm(cfg)
    assert jm.capacity_bytes == memory.UNBOUNDED_BYTES
    assert jm.actor_sizes(7) == (1, 2, 4)  # 64 divides these


def test_sft_picks_a_mesh_that_holds_the_step():
    import jax

    tiny = RunConfig()
    assert sft_mesh_size(tiny, get_preset("tiny"), jax.devices()[:8]) == 2  # sft.devices
    big = RunConfig(preset="qwen2.5-7b", model_vocab_size=None, device_memory_gib=80.0,
                    row_len=1536)
    n = sft_mesh_size(big, model_config_of(big), jax.devices()[:8])
    assert n > 2 and big.sft.batch_sequences % n == 0


def test_the_cli_refuses_a_bad_split_before_building_anything(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('system = "async"\n[topology]\ndevices = 4\nrollout_ranks = 1\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tidejax.experiments.webshop", "--config", str(config),
         "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot start: topology.rollout_ranks" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "config.json").exists()


def test_the_shipped_7b_gpu_config_fits_the_model():
    from tidejax.bench.memory import gpu_config
    from tidejax.models.config import get_preset as preset

    cfg = gpu_config("qwen2.5-7b")
    jm = layout.job_memory(cfg, preset("qwen2.5-7b"),
                           cfg.memory_fraction * cfg.device_memory_gib * memory.GIB)
    assert cfg.engine.num_pages <= memory.max_pages(jm.shape, 1, jm.engine, jm.capacity_bytes)
    partitions = jm.partitions(cfg.topology.devices)
    assert partitions and (cfg.topology.rollout_ranks, 0,
                           cfg.topology.devices - cfg.topology.rollout_ranks) in partitions
    # tide starts from the config's split, as the fixed-split systems run it
    assert layout.initial_partition(cfg, jm, 8).rollout == cfg.topology.rollout_ranks


def test_ranks_of_two_devices_count_partitions_in_ranks():
    """With `rollout_tensor = 2` ERS moves whole two-device ranks: the admitted actor sizes
    are in ranks (a 7B actor of 4 devices is 2 ranks), and the rollout rank's heads must
    divide its two devices."""
    cfg = RunConfig(preset="qwen2.5-7b", model_vocab_size=None, device_memory_gib=80.0,
                    row_len=1536, topology=TopologyConfig(devices=8, rollout_ranks=2,
                                                          rollout_tensor=2))
    jm = _jm(cfg)
    assert jm.rollout_tensor == 2
    bounds = layout.ers_config(cfg, jm, 8)
    device_sizes = jm.actor_sizes(6)
    assert bounds.actor_sizes == tuple(n // 2 for n in device_sizes if n % 2 == 0)
    assert 2 in bounds.actor_sizes  # 4 devices
    partition = layout.initial_partition(cfg, jm, 8)
    assert partition.total == 4 and partition.actor in bounds.actor_sizes
    with pytest.raises(ValueError, match="rollout_tensor must be >= 1 and divide devices"):
        TopologyConfig(devices=8, rollout_tensor=3)
    with pytest.raises(ValueError, match=r"rollout_ranks must be in \[1, 4\)"):
        TopologyConfig(devices=8, rollout_ranks=4, rollout_tensor=2)


def test_the_shipped_14b_config_fits_one_layout_and_refuses_a_four_device_actor():
    """14B on 8 x 80 GB: one two-device rollout rank beside a six-device actor mesh, which
    the model dim divides only as stored (5,120 padded to 5,160); a four-device actor (two
    rollout ranks) is refused at start, naming the bytes."""
    from tidejax.bench.memory import gpu_config
    from tidejax.models.config import get_preset as preset

    cfg = gpu_config("qwen2.5-14b")
    assert cfg.topology.rollout_tensor == 2
    jm = layout.job_memory(cfg, preset("qwen2.5-14b"),
                           cfg.memory_fraction * cfg.device_memory_gib * memory.GIB)
    assert jm.shape.stored_d_model == 5160
    assert jm.rollout_fits()
    assert cfg.engine.num_pages <= memory.max_pages(jm.shape, 2, jm.engine, jm.capacity_bytes)
    assert jm.partitions(cfg.topology.devices) == [(1, 0, 6)]
    assert layout.initial_partition(cfg, jm, 8) == layout.ers.Partition(rollout=1, actor=3)
    for system in ("async", "stream"):  # the fixed splits run the same layout
        fixed = cfg.replace(system=system)
        assert layout.initial_partition(fixed, jm, 8) == layout.ers.Partition(1, 3)
    two_ranks = cfg.replace(system="async", topology=dataclasses.replace(cfg.topology,
                                                                         rollout_ranks=2))
    with pytest.raises(layout.LayoutError, match=r"2 rollout rank\(s\), 0 reference and 4 "
                                                 r"actor device\(s\) cannot run: actor on 4 "
                                                 r"device\(s\) needs [\d.]+ GiB"):
        layout.initial_partition(two_ranks, jm, 8)


def test_one_device_runs_sync_with_rollout_and_training_taking_turns():
    cfg = RunConfig(system="sync", topology=TopologyConfig(devices=1, rollout_ranks=1))
    assert layout.sync_trainer_devices(cfg, 1) == 1
    assert layout.initial_partition(cfg, _jm(cfg, 1), 1) == layout.ers.Partition(1, 1)
    with pytest.raises(ValueError, match=r"with one device \(topology.devices\) only \"sync\""):
        RunConfig(system="tide", topology=TopologyConfig(devices=1, rollout_ranks=1))
    four = RunConfig(system="sync", topology=TopologyConfig(devices=4, rollout_ranks=3))
    assert layout.sync_trainer_devices(four, 4) == 1  # what the async trainers would get


def test_a_resumed_run_keeps_the_checkpoints_partition_only_where_ers_could_choose_it():
    P = layout.ers.Partition
    cfg = RunConfig(topology=TopologyConfig(devices=8, rollout_ranks=4))
    jm = _jm(cfg)  # tiny admits actors of 1, 2 and 4 ranks
    assert layout.resumable_partition(P(6, 2), cfg, jm, 8)
    assert layout.resumable_partition(P(4, 4), cfg, jm, 8)
    assert not layout.resumable_partition(P(5, 3), cfg, jm, 8)  # a 3-device actor
    assert not layout.resumable_partition(P(2, 2), cfg, jm, 8)  # saved on 4 devices
    assert not layout.resumable_partition(P(0, 8), cfg, jm, 8)  # below min_rollout
    # a 7B actor needs more than one 80 GB device: a checkpoint written where it fit (say
    # with more memory per device) does not resume onto one here
    big = RunConfig(preset="qwen2.5-7b", model_vocab_size=None, device_memory_gib=80.0,
                    row_len=1536, topology=TopologyConfig(devices=8, rollout_ranks=4))
    assert not layout.resumable_partition(P(7, 1), big, _jm(big), 8)
    assert layout.resumable_partition(layout.initial_partition(big, _jm(big), 8), big,
                                      _jm(big), 8)
