"""The job's command line: precedence flag > config file > preset (--quick) > default, and
paths resolved once against the working directory."""

import json
import os

import pytest

from tidejax.config import RunConfig
from tidejax.experiments.webshop import (QUICK_PRESET, build_parser, config_from_args,
                                         resume_command)


def cfg_of(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def write(tmp_path, data, name="over.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_defaults_without_flags():
    assert cfg_of() == RunConfig()


def test_quick_is_a_preset_that_flags_override():
    quick = cfg_of("--quick")
    assert quick.sft.steps == QUICK_PRESET["sft"]["steps"] == 2
    assert quick.steps == QUICK_PRESET["steps"]
    assert cfg_of("--quick", "--sft-steps", "0").sft.steps == 0
    assert cfg_of("--quick", "--sft-steps", "0").sft.episodes == QUICK_PRESET["sft"]["episodes"]
    assert cfg_of("--quick", "--steps", "5").steps == 5
    assert cfg_of("--quick", "--seed", "3").seed == 3
    assert cfg_of("--quick", "--system", "sync").system == "sync"


def test_config_file_beats_preset_and_flags_beat_file(tmp_path):
    path = write(tmp_path, {"eval_every": 3, "steps": 7, "sft": {"steps": 11},
                            "topology": {"devices": 6, "rollout_ranks": 2}})
    cfg = cfg_of("--quick", "--config", path)
    assert (cfg.eval_every, cfg.steps, cfg.sft.steps) == (3, 7, 11)
    assert cfg.sft.batch_sequences == QUICK_PRESET["sft"]["batch_sequences"]  # preset kept
    assert cfg.group_size == QUICK_PRESET["group_size"]
    cfg = cfg_of("--quick", "--config", path, "--steps", "9", "--sft-steps", "0",
                 "--devices", "4")
    assert (cfg.steps, cfg.sft.steps, cfg.eval_every) == (9, 0, 3)
    assert (cfg.topology.devices, cfg.topology.rollout_ranks) == (4, 2)


def test_devices_flag_keeps_the_default_split_valid_but_checks_a_chosen_one(tmp_path):
    assert cfg_of("--devices", "2").topology.rollout_ranks == 1
    assert cfg_of("--devices", "8").topology.rollout_ranks == RunConfig().topology.rollout_ranks
    path = write(tmp_path, {"topology": {"rollout_ranks": 3}})
    with pytest.raises(ValueError, match="rollout_ranks"):
        cfg_of("--config", path, "--devices", "2")


def test_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfgs").mkdir()
    path = write(tmp_path / "cfgs", {"hf_path": "ckpt/qwen"})
    cfg = cfg_of("--config", os.path.join("cfgs", "over.json"))
    assert cfg.hf_path == str(tmp_path / "ckpt" / "qwen")
    cfg = cfg_of("--config", path, "--tokenizer", "tok/tokenizer.json", "--hf-path", "~/m")
    assert cfg.tokenizer_path == str(tmp_path / "tok" / "tokenizer.json")
    assert cfg.hf_path == os.path.join(os.path.expanduser("~"), "m")


def test_bad_config_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="unknown config field sft.stepz"):
        cfg_of("--config", write(tmp_path, {"sft": {"stepz": 1}}))
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        cfg_of("--config", str(tmp_path / "missing.toml"))


def test_resume_command_repeats_the_flags_once():
    assert resume_command(["--quick", "--out", "runs/a b"]) == (
        "python -m tidejax.experiments.webshop --quick --out 'runs/a b' --resume")
    assert resume_command(["--resume", "--steps", "3"]).count("--resume") == 1
