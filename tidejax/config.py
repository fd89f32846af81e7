"""The job's configuration: one frozen, validated dataclass composing every part.

Each component keeps its own config next to its code (`ModelConfig`, `EngineConfig`,
`RLConfig`, `RolloutConfig`, ...); `RunConfig` composes them and adds what only the job
knows (system, steps, partition, paths). `load_run_config` reads a JSON or TOML file of
overrides; an unknown or ill-typed field fails at start with its dotted name. Relative
paths in a config are read against the working directory, like those on the command line
(`resolve_paths`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from typing import Any

from tidejax.envs.protocol import SPLITS, read_task_rows
from tidejax.envs.registry import env_settings, get_spec
from tidejax.envs.webshop import WebShopConfig
from tidejax.envs.webshop_catalogue import CatalogueConfig
from tidejax.rl.config import LossConfig, OptimConfig, RLConfig
from tidejax.runtime.config import RolloutConfig
from tidejax.sched.systems import SYSTEMS
from tidejax.serving.config import EngineConfig

# The default job's WebShop demonstrator buys without the instruction's options in half of
# its demonstrations: the warm start then chooses options about half the time, and GRPO
# has a decision to learn from the reward (WebShop's imitation agents fail the same way).
WEBSHOP_SKIP_OPTIONS = 0.5
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TopologyConfig:
    """Devices and the rollout/trainer split. A rank is `rollout_tensor` devices: one
    rollout engine's tensor-parallel group, and the unit ERS moves between roles (so the
    actor and reference meshes are whole multiples of it)."""

    devices: int = 8  # devices to use (a prefix of jax.devices())
    rollout_ranks: int = 4  # initial rollout ranks (fixed for async/stream)
    ref_ranks: int = 0  # initial dedicated reference ranks (decoupled RA2P)
    min_rollout: int = 1
    min_actor: int = 1  # ranks
    rollout_tensor: int = 1  # devices per rank (a 14B engine on 80 GB cards wants 2)

    def __post_init__(self):
        if self.devices < 1:
            raise ValueError(f"TopologyConfig.devices must be >= 1, got {self.devices}")
        if self.rollout_tensor < 1 or self.devices % self.rollout_tensor:
            raise ValueError(f"TopologyConfig.rollout_tensor must be >= 1 and divide devices "
                             f"({self.devices}), got {self.rollout_tensor}")
        if self.ranks == 1 and self.rollout_ranks == 1:
            pass  # one rank: rollout and training share it (system "sync" only)
        elif not 1 <= self.rollout_ranks < self.ranks:
            raise ValueError(f"TopologyConfig.rollout_ranks must be in [1, {self.ranks}) "
                             f"(ranks of {self.rollout_tensor} device(s)), "
                             f"got {self.rollout_ranks}")
        if self.ref_ranks < 0 or (self.ranks > 1
                                  and self.rollout_ranks + self.ref_ranks >= self.ranks):
            raise ValueError(f"TopologyConfig.ref_ranks must leave >= 1 actor rank, "
                             f"got {self.ref_ranks}")
        if self.min_rollout < 1 or self.min_actor < 1:
            raise ValueError("TopologyConfig.min_rollout and min_actor must be >= 1")

    @property
    def ranks(self) -> int:
        """Ranks of `rollout_tensor` devices the devices make."""
        return self.devices // self.rollout_tensor


@dataclasses.dataclass(frozen=True)
class SftConfig:
    """Supervised warm start on expert demonstrations."""

    episodes: int = 96
    steps: int = 60
    batch_sequences: int = 8  # rows of row_len tokens per step (several episodes per row)
    lr: float = 3e-3
    devices: int = 2  # SFT mesh size: on fake CPU devices fewer shards run faster
    # WebShop: the share of demonstrations in which the expert buys without choosing the
    # instruction's options (partial reward), so imitation leaves RL something to learn.
    # None: WEBSHOP_SKIP_OPTIONS for WebShop, a perfect demonstrator elsewhere.
    skip_options: float | None = None
    # The warm start's own seed (demonstration order, initial weights, batch order), apart
    # from the run's: RL runs of different seeds start from one warm start, as they would
    # from one pretrained or SFT checkpoint.
    seed: int = 0
    # A JSONL file of chat-message demonstrations to imitate instead of the env's expert.
    demonstrations: str | None = None

    def __post_init__(self):
        for name in ("episodes", "steps", "batch_sequences", "devices", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"SftConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"SftConfig.lr must be > 0, got {self.lr}")
        if self.skip_options is not None and not 0.0 <= self.skip_options <= 1.0:
            raise ValueError(f"SftConfig.skip_options must be in [0, 1], got {self.skip_options}")
        if self.demonstrations is not None and not os.path.isfile(self.demonstrations):
            raise ValueError(f"SftConfig.demonstrations: no such file {self.demonstrations!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    system: str = "tide"
    env_type: str = "webshop"
    preset: str = "tiny"
    hf_path: str | None = None
    tokenizer_path: str | None = None
    tokenizer_vocab: int = 2048  # BPE trained on the env's text when no tokenizer is given
    # Resize the preset's embedding (None: keep it): 2048 BPE tokens + 1,500 product ids.
    model_vocab_size: int | None = 4096
    # Mixed precision: the dtype matmuls run in and rollout weights and KV are kept in; the
    # trainer always holds float32 master weights and Adam moments. None: the preset's
    # (float32 tiny, bfloat16 Qwen2.5) or, with hf_path, the checkpoint's torch_dtype.
    compute_dtype: str | None = None
    # Memory planning (tidejax.sched.memory): the share of each device's memory the job
    # plans to use (the rest covers what the model does not see: collectives' buffers,
    # cuBLAS/cuDNN workspaces, fragmentation), and the device memory in GiB (None: what
    # the backend reports; CPU reports none, so only divisibility is checked there).
    memory_fraction: float = 0.75
    device_memory_gib: float | None = None
    seed: int = 0
    steps: int = 12
    group_size: int = 8
    batch_groups: int = 4  # B_ideal, groups per update
    min_batch_groups: int = 2  # B_min (tide's elastic batch)
    # 8 turns: search, product, up to 3 options, buy, and room for one invalid click
    max_turns: int = 8
    eval_every: int = 6
    # The default job evaluates every goal it trains on (33 on its 50-product shop), 4
    # samples each, at v0, the middle and the end: enough episodes that a gain of a few
    # hundredths of reward stands out of the evaluation's own noise. "eval" (held-out
    # goals) measures generalisation, which the tiny model does not reach (see README).
    eval_groups: int = 33  # distinct goals per evaluation
    eval_split: str = "train"  # "train": the goals GRPO trains on; "eval": held-out goals
    eval_samples: int = 4  # episodes per goal (sampled at rollout.eval_temperature)
    checkpoint_every: int = 4
    keep_checkpoints: int = 3
    micro_batch_tokens: int = 6144
    row_len: int = 1536
    env_time_scale: float = 1.0  # multiplies the env latency model (0.5: twice as fast)
    env_servers: tuple[str, ...] = ()
    long_tail_fraction: float = 0.25
    topology: TopologyConfig = TopologyConfig()
    # The shop (catalogue size, goals per product, observation mode) for env_type webshop;
    # env servers given by env_servers must be started with the same settings. The default
    # job's shop is small enough for the tiny model to learn to navigate (50 products, one
    # goal each: 33 training goals); WebShopConfig() alone is the 1,500-product shop.
    webshop: WebShopConfig = WebShopConfig(catalogue=CatalogueConfig(n_products=50,
                                                                     goals_per_product=1))
    # The env's own settings (a free `[env]` table), checked at load by the env's config
    # dataclass when it declares one; for webshop they override `webshop` field by field.
    env: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Dataset rows per split (`[task_data] train = "rows.jsonl"`): one task goal per JSONL
    # line, a `Task.data` object (prompt `messages`, `metadata`) the env reads in reset.
    # A split without a file takes its goals from the env's split_sizes.
    task_data: dict[str, str] = dataclasses.field(default_factory=dict)
    # 256 pages x 16 tokens per rank: a few WebShop contexts, so KV memory is contended.
    engine: EngineConfig = EngineConfig(page_size=16, num_pages=256, max_slots=8,
                                        max_pages_per_seq=96, prefill_buckets=(256, 768))
    # Rollouts and evaluations sample at temperature 0.5 (the trainer's log-probs follow):
    # at 1.0 the tiny warm start draws so many tail tokens (product ids not on the page,
    # clicks that loop until the context cap) that a quarter of its episodes score 0 and
    # GRPO's signal drowns in that noise (measured: eval reward 0.549 at T = 1, 0.759 at
    # T = 0.5, episodes scoring 0 26% -> 1.5%). The choice RL has to learn, choosing the
    # options or buying without them, is a near 50/50 split and stays one at T = 0.5.
    rollout: RolloutConfig = RolloutConfig(max_new_tokens=24, temperature=0.5)
    # token-mean: tokens that all members of a group share (the search, the product click)
    # get gradients that cancel exactly across the group; per-episode means weigh them by
    # 1 / episode length, so longer episodes (those that choose options) push them down.
    # The schedule (total_steps None) decays to lr / 10 over the run, and the KL to the
    # warm start holds what RL is not asked to change. lr 2.5e-4: at 5e-4 sync, on-policy,
    # overshot late (3 seeds, eval at v12: 0.852 / 0.799 / 0.867, against 0.949 / 0.963 /
    # 0.955 at 2.5e-4), and tide ended lower too (about 0.93 against 0.94); lr 2e-3 wrecked
    # the policy. off_policy "decoupled" (AReaL): tide and async train on tokens one version
    # old, and PPO's clip against that behaviour policy zeroed most of their gradient in the
    # steps where the policy moves most (seed 0, steps 3-5: gradient norm 0.17 / 0.28 / 0.05
    # against sync's 0.85 / 0.84 / 0.28; 1.27 / 0.73 / 0.29 with the decoupled loss). The
    # two losses are the same on-policy, so sync is unchanged. Advantages stay GRPO's:
    # Dr. GRPO's (no std division) left tide lower (3 seeds: 0.891; README Limits).
    rl: RLConfig = RLConfig(loss=LossConfig(kl_coef=0.05, loss_agg="token-mean",
                                            off_policy="decoupled"),
                            optim=OptimConfig(lr=2.5e-4, warmup_steps=2, total_steps=None,
                                              clip_norm=1.0))
    # The default job's warm start: 2 demonstrations per training goal, trained to imitate
    # them closely (tidejax/warm_starts/webshop-tiny ships it, built by
    # scripts/build_warm_start.sh; a run with other SFT settings trains its own).
    sft: SftConfig = SftConfig(episodes=66, steps=500, batch_sequences=4)

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise ValueError(f"RunConfig.system must be one of {tuple(SYSTEMS)}, "
                             f"got {self.system!r}")
        for name in ("steps", "group_size", "batch_groups", "min_batch_groups", "max_turns",
                     "eval_groups", "eval_samples", "micro_batch_tokens", "row_len",
                     "keep_checkpoints", "tokenizer_vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RunConfig.{name} must be a positive int, got {value!r}")
        if self.compute_dtype not in (None, *COMPUTE_DTYPES):
            raise ValueError(f"RunConfig.compute_dtype must be one of {COMPUTE_DTYPES} or "
                             f"unset, got {self.compute_dtype!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"RunConfig.memory_fraction must be in (0, 1], "
                             f"got {self.memory_fraction!r}")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ValueError(f"RunConfig.device_memory_gib must be > 0 or unset, "
                             f"got {self.device_memory_gib!r}")
        if self.group_size < 2:
            raise ValueError(f"RunConfig.group_size must be >= 2 for GRPO, got {self.group_size}")
        if self.model_vocab_size is not None and self.model_vocab_size < self.tokenizer_vocab:
            raise ValueError(f"RunConfig.model_vocab_size ({self.model_vocab_size}) must be >= "
                             f"tokenizer_vocab ({self.tokenizer_vocab})")
        if self.min_batch_groups > self.batch_groups:
            raise ValueError(f"RunConfig.min_batch_groups ({self.min_batch_groups}) must be <= "
                             f"batch_groups ({self.batch_groups})")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"RunConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_split not in SPLITS:
            raise ValueError(f"RunConfig.eval_split must be one of {SPLITS}, "
                             f"got {self.eval_split!r}")
        if self.env_time_scale < 0:
            raise ValueError(f"RunConfig.env_time_scale must be >= 0, got {self.env_time_scale}")
        if not 0 <= self.long_tail_fraction <= 1:
            raise ValueError(f"RunConfig.long_tail_fraction must be in [0, 1], "
                             f"got {self.long_tail_fraction}")
        if self.row_len > self.engine.max_seq_len:
            raise ValueError(f"RunConfig.row_len ({self.row_len}) must be <= engine.max_seq_len "
                             f"({self.engine.max_seq_len}): a trajectory must fit one row")
        if self.micro_batch_tokens < self.row_len:
            raise ValueError(f"RunConfig.micro_batch_tokens ({self.micro_batch_tokens}) must be "
                             f">= row_len ({self.row_len})")
        if self.topology.ranks == 1 and not SYSTEMS[self.system].phased:
            raise ValueError(f"RunConfig.system {self.system!r} needs separate rollout and "
                             f"trainer devices; with one device (topology.devices) only "
                             f"\"sync\" runs, rollout and training taking turns on it")
        self._check_env()
        self._check_task_data()
        if self.sft.skip_options and self.env_type != "webshop":
            raise ValueError(f"sft.skip_options is WebShop's; env_type is {self.env_type!r}")
        if self.rollout.batch_groups != self.batch_groups:
            object.__setattr__(self, "rollout",
                               dataclasses.replace(self.rollout, batch_groups=self.batch_groups))
        sampled_at = self.trainer_rl().temperature
        if self.rl.temperature not in (1.0, sampled_at):
            raise ValueError(f"RunConfig.rl.temperature ({self.rl.temperature}) is set from "
                             f"rollout.temperature ({self.rollout.temperature}): set that one")

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def trainer_rl(self) -> RLConfig:
        """`rl` as this run's trainer uses it: log-probs at the rollout temperature (greedy
        rollouts report them at T = 1), and with `rl.optim.total_steps` None a learning-rate
        schedule that spans the run's steps."""
        optim = self.rl.optim
        if optim.total_steps is None:
            optim = optim.replace(total_steps=max(self.steps, optim.warmup_steps + 1))
        return self.rl.replace(temperature=self.rollout.temperature or 1.0, optim=optim)

    def expert_kwargs(self) -> dict[str, Any]:
        """The SFT demonstrator's keyword arguments (WebShop's imperfect share)."""
        share = self.sft.skip_options
        if share is None:
            share = WEBSHOP_SKIP_OPTIONS if self.env_type == "webshop" else 0.0
        return {"skip_options": share} if share else {}

    def _check_env(self) -> None:
        """env_type must resolve (built-in, plugin or "module:Class") and `[env]` must suit
        it: both fail at load, naming the field."""
        if not isinstance(self.env, dict):
            raise ValueError(f"RunConfig.env must be a table, got {type(self.env).__name__}")
        try:
            get_spec(self.env_type)
        except ValueError as e:
            raise ValueError(f"RunConfig.env_type: {e}") from None
        try:
            env_settings(self.env_type, self.env_kwargs())
        except ValueError as e:  # the message names the field, e.g. env.catalogue.n_products
            raise ValueError(f"RunConfig.env: {e}") from None

    def _check_task_data(self) -> None:
        if not isinstance(self.task_data, dict):
            raise ValueError("RunConfig.task_data must be a table of split = \"file.jsonl\"")
        for split, path in self.task_data.items():
            if split not in SPLITS:
                raise ValueError(f"RunConfig.task_data.{split}: not a split; one of {SPLITS}")
            try:
                read_task_rows(path)
            except (OSError, ValueError) as e:
                raise ValueError(f"RunConfig.task_data.{split}: {e}") from None

    def task_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Each split's dataset rows, read from `task_data` (checked at load)."""
        return {split: read_task_rows(path) for split, path in self.task_data.items()}

    def env_kwargs(self) -> dict[str, Any]:
        """make_env keyword arguments for this run's env type: the `[env]` table (for
        webshop, on top of the `webshop` settings)."""
        if self.env_type == "webshop":
            return layer_overrides(dataclasses.asdict(self.webshop), self.env)
        return dict(self.env)


def _build(cls, data: Any, path: str):
    """Instantiate dataclass `cls` from plain data, naming the dotted path on errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'} must be a table/object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config field {path + '.' if path else ''}{unknown[0]}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        field_path = f"{path}.{key}" if path else key
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value, field_path)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{path or 'config'}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path + ': ' if path else ''}{e}") from None


def run_config_from_dict(data: dict, base: RunConfig | None = None) -> RunConfig:
    """Overrides on top of `base` (default RunConfig); nested tables merge field by field."""
    base_dict = _as_dict(base or RunConfig())
    merged = _merge(base_dict, data, "")
    return _build(RunConfig, merged, "")


def _as_dict(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = _as_dict(value) if dataclasses.is_dataclass(value) else value
    return out


FREE_TABLES = ("env", "task_data")  # RunConfig tables whose keys RunConfig does not know


def _merge(base: dict, over: dict, path: str) -> dict:
    if not isinstance(over, dict):
        raise ValueError(f"{path or 'config'} must be a table/object")
    out = dict(base)
    for key, value in over.items():
        if not path and key in FREE_TABLES:  # the env's settings: its own config checks them
            out[key] = layer_overrides(base[key], value) if isinstance(value, dict) else value
            continue
        if key not in base:
            raise ValueError(f"unknown config field {path + '.' if path else ''}{key}")
        if isinstance(base[key], dict) and isinstance(value, dict):
            out[key] = _merge(base[key], value, f"{path}.{key}" if path else key)
        else:
            out[key] = value
    return out


def read_config_file(path: str) -> dict:
    """The overrides in a `.json` or `.toml` file, as plain data (validated when built)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise ValueError(f"config file {path} is not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table/object")
    return data


def load_run_config(path: str, base: RunConfig | None = None) -> RunConfig:
    """Read overrides from a `.json` or `.toml` file."""
    return run_config_from_dict(read_config_file(path), base)


def layer_overrides(*layers: dict) -> dict:
    """Stack override dicts, later layers winning field by field (nested tables merge)."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict):  # copied, so callers may edit the result
                out[key] = layer_overrides(out.get(key) if isinstance(out.get(key), dict)
                                           else {}, value)
            else:
                out[key] = value
    return out


PATH_FIELDS = ("hf_path", "tokenizer_path")


def absolute_path(path: str) -> str:
    """`path` with `~` expanded, made absolute against the working directory."""
    return os.path.abspath(os.path.expanduser(path))


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """The config with every path field absolute (relative ones are read against the
    working directory, as on the command line), so no later chdir or library changes them."""
    cfg = cfg.replace(**{name: absolute_path(getattr(cfg, name)) for name in PATH_FIELDS
                         if getattr(cfg, name)})
    if cfg.sft.demonstrations:
        cfg = cfg.replace(sft=dataclasses.replace(
            cfg.sft, demonstrations=absolute_path(cfg.sft.demonstrations)))
    return cfg
