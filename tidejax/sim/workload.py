"""Workload models: task types, their token and latency distributions, a seeded task stream.

A workload is data (:class:`WorkloadSpec`), loadable from TOML or JSON (``load``), so a new
workload needs no code. Presets: ``text`` (WebShop + ALFWorld mix, TideRL's text suite) and
``osworld`` (OSWorld-like GUI agent: screenshots as large observations, long env waits, a
sliding history window). Each constant cites calibration.md or is marked [A] (assumption).

Every system sees the same stream: group ``i``'s trajectories are drawn from a numpy
generator seeded by ``(seed, i)`` only.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from tidejax.sched.planner import WorkloadProfile

Z99 = 2.3263  # standard normal 99th percentile


@dataclass(frozen=True, slots=True)
class Dist:
    """Lognormal by median and 99th percentile, clipped to [lo, hi]; p99 == median is fixed."""

    median: float
    p99: float
    lo: float = 0.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if self.median <= 0 or self.p99 < self.median:
            raise ValueError(f"Dist needs 0 < median <= p99, got {self.median}, {self.p99}")
        if self.lo > self.hi:
            raise ValueError(f"Dist needs lo <= hi, got {self.lo}, {self.hi}")

    def sample(self, rng: random.Random) -> float:
        sigma = math.log(self.p99 / self.median) / Z99
        x = self.median * math.exp(sigma * rng.gauss(0.0, 1.0)) if sigma > 0 else self.median
        return min(self.hi, max(self.lo, x))


@dataclass(frozen=True, slots=True)
class TaskType:
    name: str
    weight: float  # share of groups of this type (0: only after a mix shift)
    prompt_tokens: Dist  # initial prompt (shared by the group)
    response_tokens: Dist  # generated per turn
    obs_tokens: Dist  # observation appended after each turn
    env_s: Dist  # environment latency per turn
    success_prob: float  # a trajectory that succeeds stops early ...
    success_turns: Dist  # ... after this many turns; failures run to max_turns
    max_turns: int
    context_cap: int  # a trajectory stops when its context would pass this
    history_turns: int = 0  # 0: the context keeps every turn; k: only the last k turns
    train_per_turn: bool = False  # train on every turn's (context, response) (windowed agents)
    fail_response_scale: float = 1.0  # failing trajectories write longer responses
    env_straggler: Dist | None = None  # per-trajectory slowdown of its environment

    def __post_init__(self) -> None:
        if self.weight < 0 or self.max_turns <= 0 or self.context_cap <= 0:
            raise ValueError(f"TaskType {self.name}: weight >= 0, max_turns, context_cap > 0")
        if not 0 <= self.success_prob <= 1:
            raise ValueError(f"TaskType {self.name}: success_prob must be in [0, 1]")
        if self.history_turns < 0:
            raise ValueError(f"TaskType {self.name}: history_turns must be >= 0")
        if self.fail_response_scale <= 0:
            raise ValueError(f"TaskType {self.name}: fail_response_scale must be positive")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    model: str  # tidejax.sched.perf.ModelSpec preset
    types: tuple[TaskType, ...]
    # groups per update (B_ideal): 128 x 8 trajectories of ~3.9k tokens is ~4M tokens, ~20
    # micro-batches of 8k tokens per DP rank on 24 trainer GPUs, matching TideRL's "more than
    # 16 micro-batches per DP rank per step" on text workloads
    batch_groups: int = 128
    group_size: int = 8  # GRPO G (verl-agent / TideRL group sampling) [A]
    b_min_groups: int = 64  # smallest elastic batch (B_min) [A]
    eval_every: int = 10  # an evaluation phase after every this many updates (0: never)
    eval_tasks: int = 128  # evaluation trajectories per phase (one per task, G = 1)
    # TideRL's env cluster has 1024 CPU cores; two text-env sessions per core [A]
    env_capacity: int = 2048
    seed: int = 0
    # Non-stationarity, a function of a group's position in the stream only (so every system
    # sees the same groups). Response growth: group ``i``'s response tokens (median and p99,
    # the cap stays) are scaled by ``1 + response_growth * i / batch_groups``, i.e. this much
    # per update's worth of groups (reasoning RL lengthens responses as it trains,
    # DeepSeek-R1 Fig. 3) [A magnitude, a family parameter]. Mix shift: groups from update
    # ``mix_shift_at`` on (0: never) are drawn with the type weights ``mix_after``.
    response_growth: float = 0.0
    mix_shift_at: int = 0
    mix_after: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.types or sum(t.weight for t in self.types) <= 0:
            raise ValueError("WorkloadSpec.types is empty or all its weights are 0")
        if self.batch_groups <= 0 or self.group_size <= 0:
            raise ValueError("WorkloadSpec.batch_groups and group_size must be positive")
        if not 0 < self.b_min_groups <= self.batch_groups:
            raise ValueError("WorkloadSpec.b_min_groups must be in (0, batch_groups]")
        if self.eval_every < 0 or self.eval_tasks < 0 or self.env_capacity <= 0:
            raise ValueError("WorkloadSpec eval_every/eval_tasks >= 0, env_capacity > 0")
        if self.response_growth < 0 or self.mix_shift_at < 0:
            raise ValueError("WorkloadSpec.response_growth and mix_shift_at must be >= 0")
        if self.mix_shift_at and (
            len(self.mix_after) != len(self.types) or min(self.mix_after) < 0
            or sum(self.mix_after) <= 0
        ):
            raise ValueError("WorkloadSpec.mix_after needs one weight >= 0 per type, sum > 0")

    @property
    def stationary(self) -> bool:
        """No response growth, no mix shift (evaluation phases are periodic, not drift)."""
        return self.response_growth == 0 and self.mix_shift_at == 0


# ----------------------------------------------------------------------------- presets
# Environment-side stragglers (TideRL's task-diversity constraint exists to spread them): a
# per-trajectory slowdown of its env. [A] magnitude, chosen with the success/turn shapes so a
# synchronous 7B run shows calibration's workload rows: rollout share of the step 0.87
# (workload.rollout_share 0.70-0.91), last 10% of trajectories ~0.6 of the phase
# (workload.last10pct_time_share ~0.5), p99/median trajectory time ~5 (tail.p99_over_median
# up to 10). `python -m tidejax.experiments.simulate --table workload` prints these.
_STRAGGLER = Dist(1.0, 8.0, 1.0, 30.0)


def webshop() -> TaskType:
    return TaskType(
        name="webshop",
        weight=0.5,  # TideRL's text suite mixes WebShop and ALFWorld; equal shares [A]
        prompt_tokens=Dist(700, 1000),  # [A] ReAct system prompt + instruction
        response_tokens=Dist(
            120, 512, 8, 512
        ),  # cap: calibration env.tokens_per_turn.response_cap; median [A]
        obs_tokens=Dist(300, 900, 20, 1500),  # [A] search-result / item page text
        env_s=Dist(
            0.2, 2.0, 0.02, 30.0
        ),  # calibration env.webshop.step: median 0.1-0.3, p99 1-3 [L]
        success_prob=0.6,  # [A]
        success_turns=Dist(3, 12, 1, 20),  # [A] search, click item, options, buy
        max_turns=20,  # calibration env.webshop.max_turns (TideRL 20)
        context_cap=8192,  # calibration env.context_cap (TideRL text)
        fail_response_scale=1.5,  # calibration §6.5: failures run longer [A magnitude]
        env_straggler=_STRAGGLER,
    )


def alfworld() -> TaskType:
    return TaskType(
        name="alfworld",
        weight=0.5,
        prompt_tokens=Dist(900, 1200),  # [A] task description + admissible actions
        response_tokens=Dist(80, 400, 8, 512),  # cap: env.tokens_per_turn.response_cap; median [A]
        obs_tokens=Dist(80, 250, 10, 600),  # [A] short textual observations
        env_s=Dist(0.08, 0.5, 0.05, 10.0),  # calibration env.alfworld.step 0.067-0.10 s; p99 [A]
        success_prob=0.6,  # [A]
        success_turns=Dist(5, 16, 2, 20),  # [A]
        max_turns=20,  # calibration env.alfworld.max_turns (AgentBench/TideRL 15-20)
        context_cap=8192,  # calibration env.context_cap (TideRL text)
        fail_response_scale=1.5,  # calibration §6.5: failures run longer [A magnitude]
        env_straggler=_STRAGGLER,
    )


def text(model: str = "qwen2.5-7b") -> WorkloadSpec:
    """WebShop + ALFWorld, TideRL's text suite."""
    return WorkloadSpec(name=f"text-{model}", model=model, types=(webshop(), alfworld()))


def osworld(model: str = "qwen2.5-7b") -> WorkloadSpec:
    """OSWorld-like GUI agent. The calibration table has no VL model, so a 7B dense decoder
    stands in for Qwen-VL; screenshots are charged as image tokens."""
    return WorkloadSpec(
        name=f"osworld-{model}",
        model=model,
        types=(gui(),),
        batch_groups=16,  # [A] GUI RL batches are small
        group_size=8,
        b_min_groups=8,
        eval_every=10,
        eval_tasks=32,
        env_capacity=256,  # 1024 cores, a desktop VM per 4 cores [A]
    )


def gui(weight: float = 1.0) -> TaskType:
    """The OSWorld-like GUI task type: screenshots as observations, long env waits."""
    return TaskType(
        name="osworld",
        weight=weight,
        # 1920x1080 screenshot at 28x28 px per merged Qwen2.5-VL token: 69*39 = 2691 tokens [D]
        prompt_tokens=Dist(1500 + 2691, 1500 + 2691 * 1.2),  # instructions [A] + first screenshot
        response_tokens=Dist(
            200, 512, 16, 512
        ),  # cap: env.tokens_per_turn.response_cap; median [A]
        obs_tokens=Dist(2691, 2691 * 1.2),  # one screenshot per turn [D], some a11y text [A]
        env_s=Dist(
            3.0, 15.0, 0.5, 60.0
        ),  # calibration env.osworld.step_sleep 0-5 s + execution [A]
        success_prob=0.3,  # [A]
        success_turns=Dist(10, 25, 2, 30),  # [A]
        max_turns=30,  # calibration env.osworld.max_turns (DART 30)
        context_cap=16384,  # calibration env.context_cap (AstraFlow)
        history_turns=3,  # [A] agents keep the last few screenshots
        train_per_turn=True,
    )


def preset(name: str) -> WorkloadSpec:
    table = {
        "text-7b": lambda: text("qwen2.5-7b"),
        "text-14b": lambda: text("qwen2.5-14b"),
        "osworld": lambda: osworld("qwen2.5-7b"),
    }
    if name not in table:
        raise ValueError(f"unknown workload preset {name!r}; known: {sorted(table)}")
    return table[name]()


# -------------------------------------------------------------------------- loading
def _dist(d: object, where: str) -> Dist:
    if isinstance(d, (int, float)):
        return Dist(float(d), float(d))
    if not isinstance(d, dict):
        raise TypeError(f"{where}: expected a number or a table with median/p99")
    return Dist(**{k: float(v) for k, v in d.items()})


_DIST_FIELDS = (
    "prompt_tokens",
    "response_tokens",
    "obs_tokens",
    "env_s",
    "success_turns",
    "env_straggler",
)


def from_dict(data: dict) -> WorkloadSpec:
    """Build a spec from plain data (the TOML/JSON layout is the dataclass layout)."""
    data = dict(data)
    types = []
    for i, t in enumerate(data.pop("types", ())):
        t = dict(t)
        for key in _DIST_FIELDS:
            if t.get(key) is not None:
                t[key] = _dist(t[key], f"types[{i}].{key}")
        types.append(TaskType(**t))
    known = {f.name for f in fields(WorkloadSpec)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown workload keys: {sorted(unknown)}")
    if "mix_after" in data:
        data["mix_after"] = tuple(float(w) for w in data["mix_after"])
    return WorkloadSpec(types=tuple(types), **data)


def load(path: str | Path) -> WorkloadSpec:
    path = Path(path)
    text_ = path.read_text()
    data = tomllib.loads(text_) if path.suffix == ".toml" else json.loads(text_)
    return from_dict(data)


# --------------------------------------------------------------------------- stream
@dataclass(slots=True)
class Trajectory:
    """One trajectory's pre-drawn turns. ``responses[k]`` is generated in turn ``k``;
    ``obs[k]`` arrives after turn ``k`` (``env[k]`` seconds later); the last turn has none."""

    responses: list[int]
    obs: list[int]
    env: list[float]

    @property
    def turns(self) -> int:
        return len(self.responses)


@dataclass(slots=True)
class GroupDraw:
    index: int  # position in the stream (training) or in the eval stream
    type_index: int
    prompt: int
    trajectories: list[Trajectory]
    is_eval: bool = False
    meta: dict = field(default_factory=dict)


def _lognormal(d: Dist, rng: np.random.Generator, shape) -> np.ndarray:
    sigma = math.log(d.p99 / d.median) / Z99
    x = (
        d.median * np.exp(sigma * rng.standard_normal(shape))
        if sigma > 0
        else np.full(shape, d.median)
    )
    return np.clip(x, d.lo, d.hi)


def _draw_trajectory(
    t: TaskType, prompt: int, success: bool, n_success: float, resp, obs_, env_
) -> Trajectory:
    max_turns, cap, hist = t.max_turns, t.context_cap, t.history_turns
    resp_hi = t.response_tokens.hi
    turns = max(1, min(round(n_success) if success else max_turns, max_turns))
    scale = 1.0 if success else t.fail_response_scale
    responses: list[int] = []
    obs: list[int] = []
    env: list[float] = []
    window: list[int] = []
    ctx = prompt
    for k in range(turns):
        r = int(min(resp_hi, resp[k] * scale))
        if ctx + r > cap:
            break
        responses.append(r)
        if k == turns - 1:
            break
        o = int(obs_[k])
        if hist:
            window.append(r + o)
            if len(window) > hist:
                window.pop(0)
            ctx = prompt + sum(window)
        else:
            ctx += r + o
        if ctx >= cap:
            break
        obs.append(o)
        env.append(float(env_[k]))
    if not responses:  # the prompt alone nearly fills the context: one short turn
        responses.append(max(1, min(8, cap - prompt)))
    del obs[len(responses) - 1 :]
    del env[len(responses) - 1 :]
    return Trajectory(responses, obs, env)


def _cumulative(weights) -> list[float]:
    total = sum(weights)
    out, acc = [], 0.0
    for w in weights:
        acc += w / total
        out.append(acc)
    return out


class TaskStream:
    """Deterministic groups: ``group(i)`` for training, ``eval_group(i)`` for evaluation."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._cum = _cumulative([t.weight for t in spec.types])
        self._cum_after = _cumulative(spec.mix_after) if spec.mix_shift_at else self._cum

    def update_of(self, index: int, is_eval: bool) -> float:
        """The update a group belongs to: training group ``i`` feeds update
        ``i / batch_groups``; evaluation phase ``k`` runs after update ``(k + 1) * every``."""
        s = self.spec
        if not is_eval:
            return index / s.batch_groups
        return (index // max(1, s.eval_tasks) + 1) * max(1, s.eval_every)

    def _draw(self, index: int, size: int, salt: int) -> GroupDraw:
        s = self.spec
        rng = np.random.default_rng([s.seed, salt, index])
        update = self.update_of(index, salt == 1)
        cum = self._cum_after if s.mix_shift_at and update >= s.mix_shift_at else self._cum
        u = rng.random()
        ti = next((i for i, c in enumerate(cum) if u <= c), len(cum) - 1)
        t = s.types[ti]
        prompt = int(_lognormal(t.prompt_tokens, rng, ()))
        shape = (size, t.max_turns)
        resp = _lognormal(t.response_tokens, rng, shape)
        if s.response_growth:
            grown = resp * (1 + s.response_growth * update)
            resp = np.minimum(grown, t.response_tokens.hi)
        obs = _lognormal(t.obs_tokens, rng, shape)
        env = _lognormal(t.env_s, rng, shape)
        success = rng.random(size) < t.success_prob
        n_success = _lognormal(t.success_turns, rng, size)
        if t.env_straggler is not None:
            env = env * _lognormal(t.env_straggler, rng, (size, 1))
        # plain floats (exactly the float64 values) keep the per-turn loop off numpy scalars
        resp_, obs_, env_ = resp.tolist(), obs.tolist(), env.tolist()
        ok, turns = success.tolist(), n_success.tolist()
        trajs = [
            _draw_trajectory(t, prompt, ok[j], turns[j], resp_[j], obs_[j], env_[j])
            for j in range(size)
        ]
        return GroupDraw(index, ti, prompt, trajs, is_eval=salt == 1)

    def group(self, index: int) -> GroupDraw:
        return self._draw(index, self.spec.group_size, 0)

    def eval_group(self, index: int) -> GroupDraw:
        return self._draw(index, 1, 1)


def context_after(t: TaskType, prompt: int, traj: Trajectory, turns_done: int) -> int:
    """Context length before turn ``turns_done`` (prompt + kept history)."""
    if turns_done == 0:
        return prompt
    pairs = [traj.responses[k] + traj.obs[k] for k in range(turns_done)]
    if t.history_turns:
        pairs = pairs[-t.history_turns :]
    return prompt + sum(pairs)


def train_tokens(t: TaskType, prompt: int, traj: Trajectory) -> tuple[int, int]:
    """(tokens, sum of squared sequence lengths) the trainer processes for a trajectory."""
    if not t.train_per_turn:
        n = context_after(t, prompt, traj, traj.turns - 1) + traj.responses[-1]
        return n, n * n
    tokens = sq = 0
    for k in range(traj.turns):
        n = context_after(t, prompt, traj, k) + traj.responses[k]
        tokens += n
        sq += n * n
    return tokens, sq


def profile(spec: WorkloadSpec, staleness_bound: int, samples: int = 64) -> WorkloadProfile:
    """Means over the first ``samples`` groups, for the static planner."""
    stream = TaskStream(spec)
    n = turns = prompt = resp = obs = env = sq = trained = 0.0
    lat = slowest = 0.0
    for i in range(samples):
        g = stream.group(i)
        t = spec.types[g.type_index]
        # latency proxy: ~10 ms per decoded token plus env time (only the ratio is used)
        proxies = [0.01 * sum(tr.responses) + sum(tr.env) for tr in g.trajectories]
        lat += sum(proxies)
        slowest += max(proxies)
        for tr in g.trajectories:
            tok, s2 = train_tokens(t, g.prompt, tr)
            n += 1
            turns += tr.turns
            prompt += g.prompt
            resp += sum(tr.responses)
            obs += sum(tr.obs)
            env += sum(tr.env)
            sq += s2
            trained += tok
    return WorkloadProfile(
        batch_groups=spec.batch_groups,
        group_size=spec.group_size,
        mean_turns=turns / n,
        mean_prompt_tokens=prompt / n,
        mean_response_tokens=resp / turns,
        mean_obs_tokens=obs / turns,
        mean_env_s=env / turns,
        mean_sq_len=sq / n,
        mean_train_tokens=trained / n,
        group_tail=(slowest / samples) / (lat / n),
        staleness_bound=staleness_bound,
        env_capacity=spec.env_capacity,
    )
