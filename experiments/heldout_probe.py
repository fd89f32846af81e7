"""Where a WebShop warm start fails on held-out goals: search, or the product click.

    python -m tidejax.experiments.heldout_probe RUN_DIR [--config FILE] [--splits train eval]

Reads the run's tokenizer and SFT weights (RUN_DIR/tokenizer.json, sft_params.npz) and,
for each goal of each split, decodes greedily two decisions the expert also makes:
the first action (the search) from the goal's first page, and, teacher-forced on the
expert's search, the click on the results page. The click is classified: the expert's
product (the goal's target), another product id that is on the page, an id that is not on
the page (recalled rather than copied), or no id. On the default shop the target is the
first search result for every held-out goal, so copying the first id would be right.
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import jax
from tidejax.experiments.generate import greedy_generate

from tidejax import models
from tidejax.config import RunConfig, load_run_config
from tidejax.envs import expert_demonstrations
from tidejax.envs.policies import action_format
from tidejax.envs.registry import get_spec
from tidejax.envs.webshop_catalogue import get_catalogue
from tidejax.runtime.episode import action_text, add_observation, close_action, open_episode
from tidejax.runtime.job import model_config_of
from tidejax.runtime.sft import load_params

CLICK = re.compile(r"click\[(.+?)\]")


def probe_split(cfg: RunConfig, config, params, tokenizer, split: str,
                limit: int | None = None) -> dict[str, int]:
    """Counts over the split's goals (the first ``limit`` of them in a seeded order)."""
    n = get_spec(cfg.env_type).sizes(cfg.env_kwargs())[split]
    if limit is not None:
        n = min(n, limit)
    # a perfect demonstrator: its click is the product the goal asks for
    demos = expert_demonstrations(cfg.env_type, n, seed=0, split=split,
                                  env_kwargs=cfg.env_kwargs(), expert_kwargs={"skip_options": 0.0})
    asins = {p.asin for p in get_catalogue(cfg.webshop.catalogue).products}
    system = action_format(cfg.env_type)
    counts: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    for demo in demos:
        if demo.task.goal_index in seen or len(demo.turns) < 2:
            continue
        seen.add(demo.task.goal_index)
        counts["goals"] += 1
        (first_obs, expert_search), (results_obs, expert_click) = demo.turns[:2]
        ep = open_episode(tokenizer, system, first_obs)
        search = action_text(tokenizer, greedy_generate(config, params, ep.tokens, 32,
                                                         tokenizer.eos_ids))
        counts["search_exact"] += search == expert_search
        ids = tokenizer.encode(expert_search) + [tokenizer.im_end_id]
        ep.extend_generated(ids, [0.0] * len(ids), 0)
        close_action(tokenizer, ep, ids)
        add_observation(tokenizer, ep, results_obs)
        click = action_text(tokenizer, greedy_generate(config, params, ep.tokens, 16,
                                                        tokenizer.eos_ids))
        on_page = sorted((results_obs.find(a), a) for a in asins if a in results_obs)
        target, chosen = CLICK.fullmatch(expert_click), CLICK.fullmatch(click)
        want = target.group(1).upper() if target else None
        got = chosen.group(1).upper() if chosen else None
        counts["target_first_on_page"] += bool(on_page and on_page[0][1] == want)
        if got not in asins:
            counts["click_no_id"] += 1
        elif got == want:
            counts["click_target"] += 1
        elif got in {a for _, a in on_page}:
            counts["click_other_on_page"] += 1
        else:
            counts["click_not_on_page"] += 1
    return dict(counts)


def load_warm_start(cfg: RunConfig, run_dir: str):
    """The model config, SFT weights and tokenizer a run (or a shipped warm start) cached."""
    tokenizer = models.load_tokenizer(os.path.join(run_dir, "tokenizer.json"))
    config = model_config_of(cfg)
    like = models.init_params(config, jax.random.key(0))
    return config, load_params(os.path.join(run_dir, "sft_params.npz"), like), tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--config", default=None, help="the run's TOML (default: the job's)")
    parser.add_argument("--splits", nargs="+", default=["train", "eval"])
    parser.add_argument("--goals", type=int, default=None, help="at most this many per split")
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config) if args.config else RunConfig()
    config, params, tokenizer = load_warm_start(cfg, args.run_dir)
    for split in args.splits:
        counts = probe_split(cfg, config, params, tokenizer, split, args.goals)
        goals = max(1, counts.get("goals", 0))
        shares = " ".join(f"{k}={v / goals:.2f}" for k, v in sorted(counts.items()) if k != "goals")
        print(f"split={split} goals={counts.get('goals', 0)} {shares}", flush=True)


if __name__ == "__main__":
    main()
