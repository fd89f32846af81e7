"""RunConfig: the shop table and the env kwargs it hands to every env the job builds."""

import pytest

from tidejax.config import RunConfig, run_config_from_dict
from tidejax.envs import get_spec, make_env


def test_webshop_table_sets_the_shop_every_env_is_built_with():
    cfg = run_config_from_dict({"webshop": {"catalogue": {"n_products": 60,
                                                          "goals_per_product": 5}}})
    kwargs = cfg.env_kwargs()
    env = make_env("webshop", **kwargs)
    assert len(env.catalogue.products) == 60
    assert get_spec("webshop").sizes(kwargs)["train"] == len(env.catalogue.splits["train"])
    assert RunConfig(env_type="household").env_kwargs() == {}
    # the default job's small shop; WebShopConfig() alone is the 1,500-product one
    assert len(make_env("webshop", **RunConfig().env_kwargs()).catalogue.products) == 50
    assert len(make_env("webshop").catalogue.products) == 1500


@pytest.mark.parametrize("over, field", [
    ({"webshop": {"catalogue": {"n_products": 3}}}, "webshop.catalogue: n_products"),
    ({"webshop": {"catalogue": {"size": 3}}}, "webshop.catalogue.size"),
    ({"webshop": {"observation_mode": "html"}}, "webshop: observation_mode"),
])
def test_bad_shop_settings_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        run_config_from_dict(over)


def test_eval_split_must_be_a_split():
    assert run_config_from_dict({"eval_split": "train"}).eval_split == "train"
    with pytest.raises(ValueError, match="eval_split"):
        run_config_from_dict({"eval_split": "dev"})


def test_imperfect_demonstrator_setting_is_checked():
    assert run_config_from_dict({"sft": {"skip_options": 0.5}}).sft.skip_options == 0.5
    with pytest.raises(ValueError, match="SftConfig.skip_options"):
        run_config_from_dict({"sft": {"skip_options": 2}})
    with pytest.raises(ValueError, match="sft.skip_options is WebShop's"):
        run_config_from_dict({"env_type": "household", "sft": {"skip_options": 0.5}})
    # unset: WebShop's default imperfect demonstrator, a perfect one elsewhere
    assert RunConfig().expert_kwargs() == {"skip_options": 0.5}
    assert run_config_from_dict({"sft": {"skip_options": 0.0}}).expert_kwargs() == {}
    assert RunConfig(env_type="household").expert_kwargs() == {}


def test_the_run_demonstrations_follow_the_sft_table():
    from tidejax.runtime.job import demonstrations

    table = {"webshop": {"catalogue": {"n_products": 50, "goals_per_product": 1}},
             "sft": {"episodes": 40, "skip_options": 0.0}}
    full = demonstrations(run_config_from_dict(table))
    assert len(full) == 40 and all(d.won for d in full)
    table["sft"]["skip_options"] = 0.5
    imperfect = demonstrations(run_config_from_dict(table))
    assert len(imperfect) == 40 and 0 < sum(d.won for d in imperfect) < 40
    # seeded by the warm start's own seed, not the run's
    assert demonstrations(run_config_from_dict(table | {"seed": 3})) == imperfect
    assert demonstrations(run_config_from_dict(
        table | {"sft": table["sft"] | {"seed": 3}})) != imperfect


def test_trainer_log_probs_follow_the_rollout_temperature():
    cfg = run_config_from_dict({"rollout": {"temperature": 0.7}})
    assert cfg.trainer_rl().temperature == 0.7
    assert cfg.rollout.evaluation_temperature == 0.7  # evaluation samples as training does
    both = run_config_from_dict({"rollout": {"temperature": 0.7, "eval_temperature": 1.0}})
    assert (both.trainer_rl().temperature, both.rollout.evaluation_temperature) == (0.7, 1.0)
    # greedy rollouts report untempered log-probs
    assert run_config_from_dict({"rollout": {"temperature": 0.0}}).trainer_rl().temperature == 1
    with pytest.raises(ValueError, match="rl.temperature"):
        run_config_from_dict({"rollout": {"temperature": 0.7}, "rl": {"temperature": 0.5}})
    with pytest.raises(ValueError, match="RLConfig.temperature"):
        run_config_from_dict({"rl": {"temperature": 0.0}})


def test_learning_rate_schedule_spans_the_run_unless_given():
    from tidejax.rl.state import lr_schedule

    cfg = RunConfig()
    assert cfg.rl.optim.total_steps is None  # the default job's schedule follows --steps
    for steps in (12, 40):
        optim = cfg.replace(steps=steps).trainer_rl().optim
        assert optim.total_steps == steps
        end = float(lr_schedule(optim)(steps))
        assert end == pytest.approx(optim.lr * optim.end_lr_ratio)
    fixed = run_config_from_dict({"steps": 40, "rl": {"optim": {"total_steps": 1000}}})
    assert fixed.trainer_rl().optim.total_steps == 1000
    with pytest.raises(ValueError, match="total_steps is None"):
        lr_schedule(cfg.rl.optim)
