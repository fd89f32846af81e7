"""Shipped warm starts: used only by a run whose settings made them, copied, never shared."""

import json
import os

from tidejax.config import run_config_from_dict
from tidejax.runtime import shipped


def make_shipped(root, cfg, name="ws"):
    path = root / name
    path.mkdir(parents=True)
    for file in shipped.WARM_START_FILES:
        (path / file).write_text(file)
    shipped.write_fingerprint(cfg, str(path))
    return path


def test_a_run_with_the_same_settings_installs_the_shipped_warm_start(tmp_path):
    cfg = run_config_from_dict({"sft": {"steps": 7}})
    make_shipped(tmp_path / "root", cfg)
    cache = tmp_path / "run"
    cache.mkdir()
    # the run's own seed and the SFT mesh size do not change what the warm start is
    assert shipped.install(cfg.replace(seed=5), str(cache), root=str(tmp_path / "root"))
    assert (cache / "sft_params.npz").read_text() == "sft_params.npz"
    assert json.loads((cache / shipped.FINGERPRINT_FILE).read_text()) == shipped.fingerprint(cfg)


def test_other_settings_or_a_filled_cache_do_not_use_it(tmp_path):
    cfg = run_config_from_dict({"sft": {"steps": 7}})
    root = str(tmp_path / "root")
    make_shipped(tmp_path / "root", cfg)
    for other in ({"sft": {"steps": 8}}, {"sft": {"seed": 1}}, {"preset": "small"},
                  {"webshop": {"catalogue": {"n_products": 60}}}, {"row_len": 1024}):
        assert shipped.find(run_config_from_dict(other, cfg), root) is None, other
    assert shipped.fingerprint(cfg.replace(tokenizer_path="/t/tokenizer.json")) is None
    cache = tmp_path / "run"
    cache.mkdir()
    (cache / "tokenizer.json").write_text("the run's own")
    assert shipped.install(cfg, str(cache), root=root) is None
    assert (cache / "tokenizer.json").read_text() == "the run's own"
    assert not os.path.exists(cache / "sft_params.npz")
