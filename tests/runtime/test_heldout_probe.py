"""The held-out probe on the shipped warm start: it replays training goals and reads pages."""

import os

from tidejax.config import RunConfig
from tidejax.experiments import heldout_probe
from tidejax.runtime.shipped import SHIPPED_DIR


def test_probe_classifies_the_shipped_warm_starts_decisions():
    cfg = RunConfig()
    config, params, tokenizer = heldout_probe.load_warm_start(
        cfg, os.path.join(SHIPPED_DIR, "webshop-tiny"))
    train = heldout_probe.probe_split(cfg, config, params, tokenizer, "train", limit=3)
    # the default job's warm start imitates its training goals closely: the expert's
    # search and the expert's product, greedily
    assert train == {"goals": 3, "search_exact": 3, "target_first_on_page": 3,
                     "click_target": 3}
    held_out = heldout_probe.probe_split(cfg, config, params, tokenizer, "eval", limit=3)
    assert held_out["goals"] == 3
    # every click lands in exactly one class
    classes = ("click_target", "click_other_on_page", "click_not_on_page", "click_no_id")
    assert sum(held_out.get(c, 0) for c in classes) == 3
