"""Warm starts shipped with tidejax: a tokenizer and SFT weights built by a script in the repo.

A warm start is what `warm_start` caches in a run directory (`tokenizer.json`,
`sft_params.npz`) plus `warm_start.json`, the fingerprint of every setting that made them.
`scripts/build_warm_start.sh` builds one with the job's `--sft-only` and copies it under
`tidejax/warm_starts/<name>/`; a run whose settings give the same fingerprint starts from
it instead of training its own (minutes of CPU the default job would otherwise spend).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

from tidejax.config import RunConfig

log = logging.getLogger(__name__)

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "warm_starts")
FINGERPRINT_FILE = "warm_start.json"
WARM_START_FILES = ("tokenizer.json", "sft_params.npz")
FORMAT = 1


def fingerprint(cfg: RunConfig) -> dict | None:
    """Every setting the tokenizer and the SFT weights depend on (None with a checkpoint,
    tokenizer or demonstration file of the user's: what those hold is not fingerprinted)."""
    if cfg.hf_path or cfg.tokenizer_path or cfg.sft.demonstrations:
        return None
    # the mesh size is layout, and the demonstrator is what skip_options resolves to
    sft = {k: v for k, v in dataclasses.asdict(cfg.sft).items()
           if k not in ("devices", "skip_options")}
    return {"format": FORMAT, "env_type": cfg.env_type, "demonstrator": cfg.expert_kwargs(),
            "env_kwargs": json.loads(json.dumps(cfg.env_kwargs())), "preset": cfg.preset,
            "model_vocab_size": cfg.model_vocab_size, "tokenizer_vocab": cfg.tokenizer_vocab,
            "compute_dtype": cfg.compute_dtype, "row_len": cfg.row_len, "sft": sft}


def write_fingerprint(cfg: RunConfig, cache_dir: str) -> None:
    fp = fingerprint(cfg)
    if fp is not None:
        with open(os.path.join(cache_dir, FINGERPRINT_FILE), "w") as f:
            json.dump(fp, f, indent=1, sort_keys=True)


def find(cfg: RunConfig, root: str = SHIPPED_DIR) -> str | None:
    """The shipped warm start built with exactly this run's settings, if there is one."""
    fp = fingerprint(cfg)
    if fp is None or not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, FINGERPRINT_FILE)) as f:
                shipped = json.load(f)
        except (OSError, ValueError):
            continue
        if shipped == fp and all(os.path.exists(os.path.join(path, n))
                                 for n in WARM_START_FILES):
            return path
    return None


def install(cfg: RunConfig, cache_dir: str, root: str = SHIPPED_DIR) -> str | None:
    """Copy the matching shipped warm start into `cache_dir` when it has none of its own;
    returns the shipped directory used."""
    if any(os.path.exists(os.path.join(cache_dir, n)) for n in WARM_START_FILES):
        return None
    path = find(cfg, root)
    if path is None:
        return None
    for name in (*WARM_START_FILES, FINGERPRINT_FILE):
        shutil.copy(os.path.join(path, name), os.path.join(cache_dir, name))
    log.info("warm start: the shipped %s (tokenizer and SFT weights built by "
             "scripts/build_warm_start.sh with this run's settings)", os.path.basename(path))
    return path
