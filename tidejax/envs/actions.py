"""Action parsers: how the text a model writes becomes what an env's `step` receives.

A parser is a named, pluggable function `parse(text, tools) -> action` that raises
`ActionError` for text it cannot read. Built-in parsers:

- "raw": the text unchanged (the default, and what the built-in envs get);
- "bracket": a `verb[argument]` command (WebShop's), normalised to `verb[argument]`;
- "tool_call": one Qwen/hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  checked against the env's declared tools (a `Tool` per function, its parameters a JSON
  schema object); the env's step then receives a `ToolCall`.

An env class opts in by declaring `action_parser = "<name>"` and/or `tools = [...]` (tools
alone imply "tool_call"); the registry then wraps it in `ParsedActionEnv`, which turns an
unreadable action into an error observation for the model (the episode goes on; the turn
counts against its cap) with `info["action_error"]` naming the kind, which the pool
counts. The model's tokens are never rewritten: parsing reads the decoded text only.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tidejax.envs.protocol import task_from_options

ACTION_ERRORS = ("malformed", "unknown_tool", "bad_arguments")


class ActionError(Exception):
    """Text that a parser cannot turn into an action; `kind` is one of ACTION_ERRORS."""

    def __init__(self, kind: str, message: str):
        if kind not in ACTION_ERRORS:
            raise ValueError(f"kind must be one of {ACTION_ERRORS}, got {kind!r}")
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclasses.dataclass(frozen=True)
class Tool:
    """One function an env offers; `parameters` is a JSON schema object (the subset
    checked: `properties` with a `type` each, `required`, `additionalProperties`)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"tool name must be a non-empty string, got {self.name!r}")
        if self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema object")

    @classmethod
    def of(cls, value: Tool | Mapping[str, Any]) -> Tool:
        """A Tool from itself or an OpenAI-style dict ({"type": "function", "function": {...}}
        or the inner {"name", "description", "parameters"})."""
        if isinstance(value, Tool):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"a tool must be a Tool or a dict, got {type(value).__name__}")
        fn = value.get("function", value)
        return cls(fn.get("name", ""), fn.get("description", ""),
                   fn.get("parameters") or {"type": "object", "properties": {}})


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed, checked call: what a tool env's `step` receives."""

    name: str
    arguments: Mapping[str, Any]


def parse_raw(text: str, tools: Sequence[Tool] = ()) -> str:
    return text


_BRACKET = re.compile(r"\s*([A-Za-z_]\w*)\s*\[(.*)\]\s*", re.DOTALL)


def parse_bracket(text: str, tools: Sequence[Tool] = ()) -> str:
    m = _BRACKET.fullmatch(text)
    if m is None:
        raise ActionError("malformed", "write one command as verb[argument]")
    return f"{m.group(1).lower()}[{' '.join(m.group(2).split())}]"


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),)}


def parse_tool_call(text: str, tools: Sequence[Tool] = ()) -> ToolCall:
    """Exactly one `<tool_call>` JSON object per turn, naming a declared tool with
    arguments its schema accepts (arguments may also come as a JSON string)."""
    bodies = _TOOL_CALL.findall(text)
    if len(bodies) != 1:
        found = "no" if not bodies else str(len(bodies))
        raise ActionError("malformed", f"write exactly one <tool_call>{{\"name\": ..., "
                                       f"\"arguments\": {{...}}}}</tool_call>; found {found}")
    try:
        call = json.loads(bodies[0])
    except ValueError as e:
        raise ActionError("malformed", f"the tool call is not JSON: {e}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ActionError("malformed", 'the tool call must be an object with a "name"')
    by_name = {t.name: t for t in tools}
    tool = by_name.get(call["name"])
    if tool is None:
        raise ActionError("unknown_tool", f"no tool {call['name'][:80]!r}; tools: "
                                          f"{sorted(by_name)}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ActionError("malformed", "arguments is a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise ActionError("malformed", '"arguments" must be an object')
    _check_arguments(tool, arguments)
    return ToolCall(tool.name, arguments)


def _check_arguments(tool: Tool, arguments: dict[str, Any]) -> None:
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", ()) if k not in arguments]
    if missing:
        raise ActionError("bad_arguments", f"{tool.name}: missing argument {missing[0]!r}")
    if tool.parameters.get("additionalProperties", True) is False:
        extra = sorted(set(arguments) - set(props))
        if extra:
            raise ActionError("bad_arguments", f"{tool.name}: unknown argument {extra[0]!r}")
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        wrong_bool = isinstance(value, bool) and kind in ("integer", "number")
        if allowed is not None and (not isinstance(value, allowed) or wrong_bool):
            raise ActionError("bad_arguments", f"{tool.name}: argument {key!r} must be "
                                               f"a {kind}, got {json.dumps(value)[:60]}")


ActionParser = Callable[[str, Sequence[Tool]], Any]
_PARSERS: dict[str, ActionParser] = {
    "raw": parse_raw, "bracket": parse_bracket, "tool_call": parse_tool_call}
_LOCK = threading.Lock()


def register_action_parser(name: str, parser: ActionParser, *, replace: bool = False) -> None:
    with _LOCK:
        if name in _PARSERS and not replace:
            raise ValueError(f"action parser {name!r} is already registered")
        _PARSERS[name] = parser


def get_action_parser(name: str | ActionParser) -> ActionParser:
    if callable(name):
        return name
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown action parser {name!r}; known: {sorted(_PARSERS)}") from None


class ParsedActionEnv:
    """An env whose actions go through a parser; unreadable text becomes an error
    observation (counted by the pool through `info["action_error"]`)."""

    def __init__(self, env: Any, parser: ActionParser, tools: Sequence[Tool] = ()):
        self.env, self.parser, self.tools = env, parser, tuple(tools)
        self.turn, self.max_turns = 0, None

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None):
        task = task_from_options(options)
        self.turn, self.max_turns = 0, task.max_turns if task is not None else None
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str):
        self.turn += 1
        try:
            parsed = self.parser(action, self.tools)
        except ActionError as e:
            capped = self.max_turns is not None and self.turn >= self.max_turns
            return (f"Error ({e.kind}): {e.message}", 0.0, False, capped,
                    {"action_error": e.kind, "role": "tool"})
        out = self.env.step(parsed)
        if isinstance(parsed, ToolCall) and isinstance(out, tuple) and len(out) == 5 \
                and isinstance(out[4], dict) and "role" not in out[4]:
            out = (*out[:4], {**out[4], "role": "tool"})  # a tool's answer, unless it says
        return out

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str) -> Any:  # the env's own attributes (experts read state)
        if name == "env":  # not set yet: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.env, name)
