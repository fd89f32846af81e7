"""The memory model against the compiled steps' `memory_analysis()` (ahead of time, fake
devices, nothing materialised), at shapes it was fitted on and at shapes it was not.

Tolerance: 15% of each step's per-device peak, or 0.25 GiB where that is more: sub-GiB
errors matter to no plan (the job keeps a quarter of an 80 GB card in reserve), and at the
tiny CPU preset, a few hundred MiB of activations that the model is not fitted on, XLA
CPU's buffer choices dominate.
"""

import jax
import pytest

from tidejax.bench import compiled_memory as cm
from tidejax.bench.memory import calibration_config, calibration_shape
from tidejax.models.config import get_preset
from tidejax.rl.config import RLConfig
from tidejax.sched import memory
from tidejax.serving.config import EngineConfig

# Compiles 7B and 14B shapes (minutes, and several GiB of host memory each): run with -m slow.
pytestmark = pytest.mark.slow

TOLERANCE, FLOOR = 0.15, 0.25 * 2**30

TRAINER_CASES = [  # preset, layers, devices, remat, micro_batch_tokens, row_len
    ("tiny", 2, 4, False, 6144, 1536),  # not fitted on
    ("qwen2.5-0.5b", 2, 4, True, 6144, 1536),  # fitted on
    ("qwen2.5-0.5b", 2, 2, False, 8192, 2048),  # not fitted on
    ("qwen2.5-7b", 2, 4, True, 6144, 1536),  # fitted on
    ("qwen2.5-7b", 2, 8, True, 16384, 4096),  # not fitted on: the GPU config's rows
    ("qwen2.5-14b", 2, 8, True, 16384, 4096),  # a model it was not fitted on
]


def check(step, model, peak):
    error = model - peak.gpu_like
    assert abs(error) <= max(TOLERANCE * peak.gpu_like, FLOOR), (
        f"{step}: model {model / 2**30:.2f} GiB vs compiled {peak.gpu_like / 2**30:.2f} GiB "
        f"({error / peak.gpu_like:+.1%})")


@pytest.mark.parametrize("preset,layers,devices,remat,mbt,row_len", TRAINER_CASES)
def test_trainer_steps_within_tolerance(preset, layers, devices, remat, mbt, row_len):
    config = calibration_config(preset, layers)
    rows = memory.trainer_rows(mbt, row_len, devices)
    rl = RLConfig(remat=remat)
    shape = calibration_shape(config)
    peaks = cm.trainer_peaks(config, rl, jax.devices()[:devices], rows, row_len,
                             shape.stored_d_model)
    peaks["ref"] = cm.ref_peak(config, rl, jax.devices()[:devices], rows, row_len,
                               shape.stored_d_model)
    batch = memory.TrainerBatch(rows, row_len, remat)
    for step, peak in peaks.items():
        model = (memory.ref_step(shape, devices, batch) if step == "ref"
                 else memory.trainer_step(shape, devices, batch, step)).total
        check(step, model, peak)


ENGINE_CASES = [  # preset, layers, tensor, pages, slots, pages per sequence, bucket
    ("qwen2.5-0.5b", 2, 1, 2048, 32, 256, 1024),  # fitted on
    ("qwen2.5-7b", 2, 1, 4096, 32, 256, 1024),  # fitted on
    ("qwen2.5-7b", 2, 1, 8192, 64, 256, 1024),  # not fitted on: the GPU config's engine
    ("qwen2.5-14b", 2, 1, 4096, 32, 256, 1024),  # a model it was not fitted on
]


@pytest.mark.parametrize("preset,layers,tensor,pages,slots,per_seq,bucket", ENGINE_CASES)
def test_engine_steps_within_tolerance(preset, layers, tensor, pages, slots, per_seq, bucket):
    config = calibration_config(preset, layers)
    ec = EngineConfig(page_size=16, num_pages=pages, max_slots=slots,
                      max_pages_per_seq=per_seq, prefill_buckets=(bucket,))
    peaks = cm.engine_peaks(config, ec, jax.devices()[:tensor])
    shape, engine = memory.ModelShape.of(config), memory.EngineShape.of(ec)
    for step, peak in peaks.items():
        check(step, memory.engine_step(shape, tensor, engine, step).total, peak)


def test_depth_extrapolation_matches_a_full_compile():
    """Two shallow compiles extrapolated to 24 layers vs compiling all 24 (0.5B decode)."""
    config = get_preset("qwen2.5-0.5b")
    ec = EngineConfig(page_size=16, num_pages=512, max_slots=8, max_pages_per_seq=64,
                      prefill_buckets=(256,))

    def measure(c):
        return cm.engine_peaks(c, ec, jax.devices()[:1])

    full = measure(config)
    guess = cm.extrapolate(measure, config, (2, 3))
    for step in full:
        assert abs(guess[step].compiled - full[step].compiled) <= 0.05 * full[step].compiled
