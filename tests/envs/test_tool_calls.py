"""Tool calls: an env (defined here) declaring two tools, driven by a scripted policy that
writes valid, malformed, unknown and ill-typed calls, in process and behind the server."""

import asyncio

import pytest

from tidejax.envs import (ActionError, EnvPool, EnvServer, PoolConfig, ServerConfig, Task,
                          ToolCall, get_spec)
from tidejax.envs.actions import Tool, parse_bracket, parse_tool_call


class CalculatorEnv:
    """Reach the target number with add(); submit(answer) ends the episode."""

    split_sizes = {"train": 10, "eval": 5, "test": 5}
    max_turns = 8
    action_format = "Call one tool per turn."
    tools = [
        {"type": "function", "function": {
            "name": "add", "description": "Adds two integers.",
            "parameters": {"type": "object", "required": ["a", "b"], "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
        Tool("submit", "Submits the answer.", {"type": "object", "required": ["answer"],
                                                "additionalProperties": False,
                                                "properties": {"answer": {"type": "integer"}}}),
    ]
    calls: list = []  # every call that reached an env (class-level: the test reads it)

    def reset(self, seed=None, options=None):
        self.target = 10 + options["task"].goal_index
        return f"Make {self.target}.", {}

    def step(self, call):
        assert isinstance(call, ToolCall)  # only parsed, checked calls get here
        CalculatorEnv.calls.append((call.name, dict(call.arguments)))
        if call.name == "add":
            return str(call.arguments["a"] + call.arguments["b"]), 0.0, False, False, {}
        won = call.arguments["answer"] == self.target
        return "Submitted.", float(won), True, False, {"won": won}

    def close(self):
        pass


SCRIPT = [
    '<tool_call>{"name": "add", "arguments": {"a": 9, "b": 3}}</tool_call>',  # valid
    '<tool_call>{"name": "add", "arguments": {"a": 9, </tool_call>',  # malformed JSON
    'I think the answer is 12.',  # no call at all
    '<tool_call>{"name": "multiply", "arguments": {"a": 2}}</tool_call>',  # unknown tool
    '<tool_call>{"name": "add", "arguments": {"a": "9", "b": 3}}</tool_call>',  # ill-typed
    'Sure. <tool_call>{"name": "submit", "arguments": "{\\"answer\\": 12}"}</tool_call>',
]


async def play(pool, name):
    task = Task("c0", "g0", "train", name, 2, 8)
    results = [await pool.reset(task)]
    for action in SCRIPT:
        results.append(await pool.step("c0", action))
    return results, pool.stats


@pytest.mark.parametrize("where", ["local", "server"])
def test_valid_calls_reach_the_env_and_bad_ones_become_error_observations(where):
    name = f"{__name__}:CalculatorEnv"
    CalculatorEnv.calls.clear()
    assert "# Tools" in get_spec(name).action_format and '"add"' in get_spec(name).action_format

    async def run():
        if where == "local":
            async with EnvPool(PoolConfig(max_retries=0)) as pool:
                return await play(pool, name)
        with EnvServer(ServerConfig(port=0, env_types=(name,))) as server:
            async with EnvPool(PoolConfig(max_retries=0), addresses=[server.address]) as pool:
                return await play(pool, name)

    results, stats = asyncio.run(run())
    assert all(r.ok for r in results)  # no task crashed
    assert results[1].obs == "12"
    kinds = [r.info.get("action_error") for r in results[2:6]]
    assert kinds == ["malformed", "malformed", "unknown_tool", "bad_arguments"]
    assert all(r.obs.startswith("Error (") and not r.done for r in results[2:6])
    assert results[-1].terminated and results[-1].reward == 1.0
    assert CalculatorEnv.calls == [("add", {"a": 9, "b": 3}), ("submit", {"answer": 12})]
    assert (stats.malformed, stats.unknown_tool, stats.bad_arguments) == (2, 1, 1)


def test_error_turns_count_against_the_turn_cap():
    name = f"{__name__}:CalculatorEnv"

    async def run():
        async with EnvPool(PoolConfig(max_retries=0)) as pool:
            await pool.reset(Task("c1", "g1", "train", name, 0, 2))
            first = await pool.step("c1", "no call")
            second = await pool.step("c1", "still no call")
            return first, second

    first, second = asyncio.run(run())
    assert not first.done and second.truncated and second.ok


def test_parsers():
    tools = [Tool("submit", parameters={"type": "object", "properties": {
        "answer": {"type": "integer"}}, "required": ["answer"]})]
    assert parse_tool_call('<tool_call>{"name": "submit", "arguments": {"answer": 3}}'
                           '</tool_call>', tools) == ToolCall("submit", {"answer": 3})
    for text, kind in [('<tool_call>{"name": "submit"}</tool_call>', "bad_arguments"),
                       ('<tool_call>{"name": "submit", "arguments": {"answer": true}}'
                        '</tool_call>', "bad_arguments"),
                       ('<tool_call>{"arguments": {}}</tool_call>', "malformed"),
                       ('<tool_call>{"name": "submit", "arguments": {"answer": 1}}</tool_call>'
                        '<tool_call>{"name": "submit", "arguments": {"answer": 2}}</tool_call>',
                        "malformed")]:
        with pytest.raises(ActionError) as e:
            parse_tool_call(text, tools)
        assert e.value.kind == kind, text
    assert parse_bracket("  Click[ Buy  Now ] ") == "click[Buy Now]"
    with pytest.raises(ActionError, match="verb"):
        parse_bracket("buy it")
