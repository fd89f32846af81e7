"""Tasks that carry a dataset row, observations with a role, per-step rewards with a
declared return rule: through make_tasks, the config's `[task_data]` and the manager."""

import json

import pytest

from tests.runtime.mock_rollout import run_on_one_mock_rank
from tidejax.config import run_config_from_dict
from tidejax.envs import Task, make_tasks
from tidejax.envs.protocol import MalformedObservation, read_task_rows, validate_step
from tidejax.envs.registry import episode_return, get_spec

ROWS = [{"messages": [{"role": "system", "content": "You grade answers."},
                      {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
         "metadata": {"answer": str(2 * i)}} for i in range(5)]


class StepRewardEnv:
    """Pays 0.5, 1.0, 0.25 on its three steps whatever the action (the mock engine writes
    noise); answers as a tool after the first step; reads its task's dataset row."""

    split_sizes = {"train": 5, "eval": 5, "test": 5}
    max_turns = 3
    action_format = "Answer the question."
    REWARDS = (0.5, 1.0, 0.25)
    seen_rows: list = []

    def reset(self, seed=None, options=None):
        task = options["task"]
        self.turn = 0
        StepRewardEnv.seen_rows.append(task.data)
        return "", {}  # the row's messages are the prompt

    def step(self, action):
        reward = self.REWARDS[self.turn]
        self.turn += 1
        done = self.turn == len(self.REWARDS)
        return f"tool result {self.turn}", reward, done, False, {"role": "tool", "won": done}

    def close(self):
        pass


class SummedEnv(StepRewardEnv):
    return_rule = "sum"


class MaxEnv(StepRewardEnv):
    return_rule = "max"


def test_make_tasks_takes_one_goal_per_row_and_carries_it():
    tasks = make_tasks(f"{__name__}:StepRewardEnv", "train", 3, 2, seed=4, rows=ROWS)
    assert len(tasks) == 6
    for task in tasks:
        assert task.data == ROWS[task.goal_index]
        assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task  # travels as JSON
    again = make_tasks(f"{__name__}:StepRewardEnv", "train", 3, 2, seed=4, rows=ROWS)
    assert again == tasks


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x"}, "unknown keys"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
     "system message may only come first"),
    ({"messages": [{"role": "user"}]}, "exactly a 'role' and a string 'content'"),
    ({"metadata": [1]}, "'metadata' must be an object"),
])
def test_bad_task_data_is_refused_naming_the_problem(row, message):
    with pytest.raises(ValueError, match=message):
        Task("t", "g", "train", "webshop", 0, 3, data=row)


def test_task_data_files_are_checked_at_load_naming_field_and_line(tmp_path):
    good = tmp_path / "rows.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert read_task_rows(str(good)) == ROWS
    cfg = run_config_from_dict({"task_data": {"train": str(good)}})
    assert cfg.task_rows()["train"] == ROWS
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + '{"messages": 3}\n')
    with pytest.raises(ValueError, match=r"RunConfig\.task_data\.train: .*bad\.jsonl line 2"):
        run_config_from_dict({"task_data": {"train": str(bad)}})
    with pytest.raises(ValueError, match=r"RunConfig\.task_data\.dev: not a split"):
        run_config_from_dict({"task_data": {"dev": str(good)}})
    with pytest.raises(ValueError, match=r"RunConfig\.task_data\.eval: .*No such file"):
        run_config_from_dict({"task_data": {"eval": str(tmp_path / "missing.jsonl")}})


def test_return_rules_and_roles_are_checked():
    assert episode_return("last", [0.5, 0.25, 1.0]) == 1.0
    assert episode_return("sum", [0.5, 0.25, 1.0]) == 1.75
    assert episode_return("max", [0.5, 0.25, 0.0]) == 0.5
    assert episode_return("sum", []) == 0.0
    with pytest.raises(ValueError, match="return_rule"):
        episode_return("mean", [1.0])
    with pytest.raises(MalformedObservation, match="role"):
        validate_step(("obs", 0.0, False, False, {"role": "assistant"}), 100)

    class BadRule(StepRewardEnv):
        return_rule = "mean"

    globals()["BadRule"] = BadRule
    try:
        with pytest.raises(ValueError, match="return_rule must be one of"):
            get_spec(f"{__name__}:BadRule")
    finally:
        del globals()["BadRule"]


def run_manager(env_name: str):
    tasks = make_tasks(env_name, "train", 2, 2, seed=0, rows=ROWS)
    _, buffer, _, tok = run_on_one_mock_rank(env_name, tasks, 2)
    return tasks, buffer.take(10, trainer_version=0), tok


@pytest.mark.parametrize("env, expected", [("StepRewardEnv", 0.25), ("SummedEnv", 1.75),
                                           ("MaxEnv", 1.0)])
def test_episode_return_follows_the_env_rule(env, expected):
    _, groups, _ = run_manager(f"{__name__}:{env}")
    rewards = [t.reward for g in groups for t in g.payload.trajectories]
    assert rewards == [expected] * 4


def test_rows_prompt_the_episode_and_tool_observations_are_tool_turns():
    StepRewardEnv.seen_rows.clear()
    tasks, groups, tok = run_manager(f"{__name__}:StepRewardEnv")
    assert sorted(json.dumps(r) for r in StepRewardEnv.seen_rows) == sorted(
        json.dumps(t.data) for t in tasks)  # reset saw each task's row
    by_id = {tid: traj for g in groups for tid, traj in zip(g.payload.task_ids,
                                                            g.payload.trajectories)}
    for task in tasks:
        tokens = list(by_id[task.task_id].tokens)
        system, question = (m["content"] for m in task.data["messages"])
        # the row's system message replaces the env's; its user message follows; the empty
        # first observation adds no turn
        prompt = (tok.turn("system", system) + tok.turn("user", question)
                  + tok.turn_prefix("assistant"))
        assert tokens[:len(prompt)] == prompt
        tool_turn = tok.turn("tool", "tool result 1") + tok.turn_prefix("assistant")
        assert any(tokens[i:i + len(tool_turn)] == tool_turn for i in range(len(tokens)))
        assert "<tool_response>" in tok.decode(tokens, skip_special_tokens=False)
