"""Time-performance models: what a step of decode, prefill, training or a swap costs.

Pure arithmetic over frozen specs, used by the static planner (to predict) and by the
simulator (as its ground truth), so both read the same curves. Formulas follow
``shared/calibration.md`` §6; every preset constant cites its row there (tags: [P] primary,
[D] derived, [A] assumption, H/M/L confidence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {value!r}")


def _fraction(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0 < value <= 1:
            raise ValueError(f"{type(obj).__name__}.{name} must be in (0, 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A dense decoder as the cost models see it."""

    name: str
    params: float  # N, parameters
    weight_bytes: float  # bf16 weights, bytes
    kv_bytes_per_token: float  # K+V over all layers, bytes per token
    n_layers: int
    d_model: int
    train_state_bytes_per_param: float = 16.0  # calibration model.train_state_bytes_per_param

    def __post_init__(self) -> None:
        _positive(self, "params", "weight_bytes", "kv_bytes_per_token", "n_layers", "d_model")
        _positive(self, "train_state_bytes_per_param")

    @classmethod
    def qwen25_7b(cls) -> ModelSpec:
        return cls(
            name="qwen2.5-7b",
            params=7.62e9,  # calibration model.q7b.params (HF config) [H]
            weight_bytes=1.5231e10,  # calibration model.q7b.weight_bytes [H]
            kv_bytes_per_token=57_344,  # calibration model.q7b.kv_bytes_per_token [H]
            n_layers=28,  # Qwen2.5-7B HF config num_hidden_layers
            d_model=3584,  # Qwen2.5-7B HF config hidden_size
        )

    @classmethod
    def qwen25_14b(cls) -> ModelSpec:
        return cls(
            name="qwen2.5-14b",
            params=1.477e10,  # calibration model.q14b.params (HF config) [H]
            weight_bytes=2.95e10,  # calibration model.q14b.weight_bytes [H]
            kv_bytes_per_token=196_608,  # calibration model.q14b.kv_bytes_per_token [H]
            n_layers=48,  # Qwen2.5-14B HF config num_hidden_layers
            d_model=5120,  # Qwen2.5-14B HF config hidden_size
        )

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        presets = {"qwen2.5-7b": cls.qwen25_7b, "qwen2.5-14b": cls.qwen25_14b}
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(presets)}")
        return presets[name]()


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator type and its links."""

    name: str
    flops: float  # dense bf16, FLOP/s
    hbm_bw: float  # B/s
    hbm_cap: float  # B
    decode_bw_eff: float  # fraction of HBM bandwidth decode reaches
    decode_mfu: float  # compute floor of a decode step, fraction of peak
    prefill_mfu: float
    train_mfu: float
    step_overhead_s: float  # per decode iteration
    short_ctx_derate: float  # throughput factor when mean context < short_ctx_tokens
    short_ctx_tokens: int
    mem_util: float  # fraction of HBM the serving engine may use
    act_reserve_bytes: float  # engine activations / graphs kept out of the KV pool
    train_act_bytes: float  # trainer activation memory per GPU
    pcie_h2d: float  # B/s
    pcie_d2h: float  # B/s
    nvlink_bw: float  # B/s per direction
    ib_bw: float  # B/s per GPU across nodes
    bcast_bw: float  # B/s of a cross-node weight broadcast
    sync_fixed_s: float
    gpus_per_node: int

    def __post_init__(self) -> None:
        _positive(self, "flops", "hbm_bw", "hbm_cap", "pcie_h2d", "pcie_d2h", "nvlink_bw")
        _positive(self, "ib_bw", "bcast_bw", "gpus_per_node", "short_ctx_tokens")
        _fraction(self, "decode_bw_eff", "decode_mfu", "prefill_mfu", "train_mfu", "mem_util")
        _fraction(self, "short_ctx_derate")
        if self.step_overhead_s < 0 or self.sync_fixed_s < 0:
            raise ValueError("HardwareSpec.step_overhead_s and sync_fixed_s must be >= 0")
        if self.act_reserve_bytes < 0 or self.train_act_bytes < 0:
            raise ValueError("HardwareSpec activation reserves must be >= 0")

    @classmethod
    def h100(cls) -> HardwareSpec:
        return cls(
            name="h100-sxm",
            flops=989e12,  # calibration hw.h100.bf16_dense_flops [H]
            hbm_bw=3.35e12,  # calibration hw.h100.hbm_bw [H]
            hbm_cap=80e9,  # calibration hw.h100.hbm_cap [H]
            decode_bw_eff=0.8,  # calibration hw.decode_bw_efficiency 0.75-0.80 (and t_weights rows) [M]
            decode_mfu=0.5,  # calibration pf.mfu 0.4-0.6, midpoint, as decode's compute floor [L]
            prefill_mfu=0.5,  # calibration pf.mfu 0.4-0.6 midpoint -> 3.2e4 tok/s 7B, in pf.q7b range
            train_mfu=0.4,  # calibration train.mfu_bf16 0.33-0.45 -> 7.8e3 tok/s 7B, train.q7b range
            step_overhead_s=5e-4,  # calibration dec.step_overhead [A, L]
            short_ctx_derate=0.7,  # calibration dec.short_ctx_derate 0.6-0.75 [M]
            short_ctx_tokens=2048,  # calibration §6.1: derate applies when sum(L)/B < 2k
            mem_util=0.9,  # vLLM EngineArgs gpu_memory_utilization default 0.9 (vLLM docs)
            act_reserve_bytes=4e9,  # [A] activations + CUDA graphs outside the KV pool (new)
            train_act_bytes=20e9,  # [A] trainer activations per GPU at 8k-token micro-batches (new)
            pcie_h2d=3.5e10,  # calibration hw.pcie5_h2d_bw, measured SM-copy value [M]
            pcie_d2h=5.28e10,  # calibration hw.pcie5_d2h_bw [H]
            nvlink_bw=3.8e11,  # calibration hw.nvlink_p2p_bw [H]
            ib_bw=5.0e10,  # calibration hw.ib_per_gpu_bw [M]
            bcast_bw=2.5e10,  # calibration hw.nic_single_bcast_bw [M]
            sync_fixed_s=1.0,  # calibration sync.fixed_overhead 0.2-2 s, geometric-ish middle [L]
            gpus_per_node=8,  # TideRL testbed: 4 nodes x 8 H100
        )


# ---------------------------------------------------------------------- rollout engine
def kv_capacity_tokens(model: ModelSpec, hw: HardwareSpec, tp: int = 1) -> int:
    """KV pool size of one rollout rank, tokens (calibration §6.1)."""
    free = hw.mem_util * hw.hbm_cap * tp - model.weight_bytes - hw.act_reserve_bytes * tp
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {tp} x {hw.name} for serving")
    return int(free / model.kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class DecodeCurve:
    """Per-iteration decode time ``max(a + b*sum(L), c*B) + ovh`` of one rank (seconds).

    a = W/(tp*eta*BW) reads weights, b = kv/(tp*eta*BW) reads one context token's K/V,
    c = 2N/(tp*mfu*F) is the compute floor per sequence; the short-context derate divides
    throughput when mean context is below ``short_ctx``.
    """

    a: float
    b: float
    c: float
    ovh: float
    derate: float
    short_ctx: int

    @classmethod
    def of(cls, model: ModelSpec, hw: HardwareSpec, tp: int = 1) -> DecodeCurve:
        bw = tp * hw.decode_bw_eff * hw.hbm_bw
        return cls(
            a=model.weight_bytes / bw,
            b=model.kv_bytes_per_token / bw,
            c=2 * model.params / (tp * hw.decode_mfu * hw.flops),
            ovh=hw.step_overhead_s,
            derate=hw.short_ctx_derate,
            short_ctx=hw.short_ctx_tokens,
        )

    def iters_time(self, batch: int, ctx_sum: float, k: int) -> float:
        """Time of ``k`` iterations of ``batch`` sequences starting at total context ``ctx_sum``.

        Every iteration adds one token per sequence, so total context grows by ``batch``.
        """
        if k <= 0 or batch <= 0:
            return 0.0
        comp = self.c * batch
        base = self.a + self.b * ctx_sum
        step = self.b * batch
        # first iteration whose memory time reaches the compute floor
        if base >= comp:
            cross = 0
        else:
            cross = min(k, math.ceil((comp - base) / step)) if step > 0 else k
        mem = (k - cross) * base + step * (k * (k - 1) - cross * (cross - 1)) / 2
        total = cross * comp + mem + k * self.ovh
        if ctx_sum < self.short_ctx * batch:
            total /= self.derate
        return total

    def _memory_bound_guess(self, batch: int, ctx_sum: float, dt: float, base: float) -> int:
        """Iterations within ``dt`` from the closed form of the memory-bound sum (callers
        correct it by a step or two against ``iters_time``)."""
        scale = self.derate if ctx_sum < self.short_ctx * batch else 1.0
        step = self.b * batch
        lin = base + self.ovh - step / 2
        budget = dt * scale
        if step > 0:
            return max(0, int((-lin + math.sqrt(lin * lin + 2 * step * budget)) / step))
        return max(0, int(budget / (base + self.ovh)))

    def iters_reaching(self, batch: int, ctx_sum: float, dt: float) -> tuple[int, float]:
        """Smallest ``k`` with ``iters_time(batch, ctx_sum, k) >= dt`` (the first iteration
        boundary at or after ``dt``) and that time: the same search as :meth:`iters_within`
        plus one step, reusing the times it computed (the simulator's hot path)."""
        if dt <= 0 or batch <= 0:
            return 0, 0.0
        time = self.iters_time
        base = self.a + self.b * ctx_sum
        if base >= self.c * batch:  # memory-bound throughout: solve the quadratic, then fix up
            k = self._memory_bound_guess(batch, ctx_sum, dt, base)
            tk = time(batch, ctx_sum, k)
            while k > 0 and tk > dt:
                k -= 1
                tk = time(batch, ctx_sum, k)
            t1 = time(batch, ctx_sum, k + 1)
            while t1 <= dt:
                k, tk = k + 1, t1
                t1 = time(batch, ctx_sum, k + 1)
        else:
            lo, hi, tk = 0, 1, 0.0
            t1 = time(batch, ctx_sum, hi)
            while t1 <= dt:
                lo, hi, tk = hi, hi * 2, t1
                t1 = time(batch, ctx_sum, hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                tm = time(batch, ctx_sum, mid)
                if tm <= dt:
                    lo, tk = mid, tm
                else:
                    hi, t1 = mid, tm
            k = lo
            t1 = t1 if hi == k + 1 else time(batch, ctx_sum, k + 1)
        # k is iters_within's answer and tk its time; t1 the time of k + 1 iterations
        return (k, tk) if tk >= dt else (k + 1, t1)

    def iters_within(self, batch: int, ctx_sum: float, dt: float) -> int:
        """Largest ``k`` with ``iters_time(batch, ctx_sum, k) <= dt``."""
        if dt <= 0 or batch <= 0:
            return 0
        base = self.a + self.b * ctx_sum
        if base >= self.c * batch:  # memory-bound throughout: solve the quadratic, then fix up
            k = self._memory_bound_guess(batch, ctx_sum, dt, base)
            while k > 0 and self.iters_time(batch, ctx_sum, k) > dt:
                k -= 1
            while self.iters_time(batch, ctx_sum, k + 1) <= dt:
                k += 1
            return k
        lo, hi = 0, 1
        while self.iters_time(batch, ctx_sum, hi) <= dt:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.iters_time(batch, ctx_sum, mid) <= dt:
                lo = mid
            else:
                hi = mid
        return lo


def prefill_time(
    model: ModelSpec, hw: HardwareSpec, n_new: float, n_cached: float, tp: int = 1
) -> float:
    """Prefill ``n_new`` tokens after ``n_cached`` cached ones (calibration §6.1)."""
    if n_new <= 0:
        return 0.0
    flops = 2 * model.params * n_new + 4 * model.n_layers * model.d_model * n_new * (
        n_cached + n_new / 2
    )
    return flops / (tp * hw.prefill_mfu * hw.flops)


def prefill_coeffs(model: ModelSpec, hw: HardwareSpec, tp: int = 1) -> tuple[float, int, float]:
    """``(lin, attn, rate)`` with :func:`prefill_time` ``= (lin*n + attn*n*(c + n/2)) / rate``
    for ``n > 0``, evaluated in the same order (so bit-identical) without the spec look-ups."""
    return 2 * model.params, 4 * model.n_layers * model.d_model, tp * hw.prefill_mfu * hw.flops


# ---------------------------------------------------------------------------- trainer
def train_time(
    model: ModelSpec, hw: HardwareSpec, tokens: float, sq_tokens: float, n_gpus: int
) -> float:
    """Actor forward+backward over sequences totalling ``tokens`` (calibration §6.2).

    ``sq_tokens`` is the sum of squared sequence lengths: attention FLOPs per token grow with
    the token's own sequence length, so the per-token term 12*layers*d*L sums to
    12*layers*d*sum(len^2).
    """
    if tokens <= 0:
        return 0.0
    if n_gpus <= 0:
        raise ValueError(f"n_gpus must be positive, got {n_gpus}")
    flops = 6 * model.params * tokens + 12 * model.n_layers * model.d_model * sq_tokens
    return flops / (n_gpus * hw.train_mfu * hw.flops)


REF_COST_RATIO = 1 / 3  # calibration ref.fwd_cost_ratio: 2N vs 6N [D]


def ref_time(
    model: ModelSpec, hw: HardwareSpec, tokens: float, sq_tokens: float, n_gpus: int
) -> float:
    """Reference forward: a third of the training cost per token."""
    return REF_COST_RATIO * train_time(model, hw, tokens, sq_tokens, n_gpus)


def min_train_gpus(model: ModelSpec, hw: HardwareSpec) -> int:
    """Fewest GPUs whose HBM holds the sharded train state plus activations."""
    room = hw.mem_util * hw.hbm_cap - hw.train_act_bytes
    return max(1, math.ceil(model.params * model.train_state_bytes_per_param / room))


# Bytes per parameter that a colocated Ref<->Actor alternation moves: the ref's bf16 weights
# come in; the actor's bf16 weights and bf16 grads (4 of the 16 B/param accounting) go out
# and come back; fp32 master and Adam moments stay put until the optimizer step. [D]
REF_WEIGHT_BYTES_PER_PARAM = 2.0
ACTOR_SWAP_BYTES_PER_PARAM = 4.0


def swap_time(model: ModelSpec, hw: HardwareSpec, shards: int) -> float:
    """One Ref phase inserted between Actor work on a colocated trainer (both directions).

    Ref weights in (H2D) overlap the actor going out (D2H, PCIe is full duplex); the actor
    comes back in afterwards while the frozen ref is simply dropped (a host copy exists).
    """
    if shards <= 0:
        raise ValueError(f"shards must be positive, got {shards}")
    ref_in = REF_WEIGHT_BYTES_PER_PARAM * model.params / shards / hw.pcie_h2d
    actor_out = ACTOR_SWAP_BYTES_PER_PARAM * model.params / shards / hw.pcie_d2h
    actor_in = ACTOR_SWAP_BYTES_PER_PARAM * model.params / shards / hw.pcie_h2d
    return max(ref_in, actor_out) + actor_in


def weight_load_time(model: ModelSpec, hw: HardwareSpec, shards: int = 1) -> float:
    """Load a model's bf16 weights from host memory (H2D)."""
    return model.weight_bytes / shards / hw.pcie_h2d


def sync_time(model: ModelSpec, hw: HardwareSpec, cross_node: bool) -> float:
    """Trainer -> rollout weight sync: W / path bandwidth + fixed cost (calibration §6.3)."""
    bw = hw.bcast_bw if cross_node else hw.nvlink_bw
    return model.weight_bytes / bw + hw.sync_fixed_s


def reshard_time(model: ModelSpec, hw: HardwareSpec, new_gpus: int) -> float:
    """Re-shard the train state when the actor gains or loses a rank: the changed rank's
    share (state / new size) crosses the inter-node fabric. [D]"""
    if new_gpus <= 0:
        raise ValueError(f"new_gpus must be positive, got {new_gpus}")
    return model.params * model.train_state_bytes_per_param / new_gpus / hw.ib_bw
