"""Chat templates: the text around each message, so conversations tokenize one turn at a time.

A `ChatTemplate` gives, for a message of some role, the text before its content and the
text after it. `Tokenizer` encodes before, content and after separately and concatenates
the ids, so a turn's content ids are always `encode(content)` whatever came before:
rollouts append turns and never re-tokenize history.

`CHATML` is the built-in format. `from_jinja` turns a Hugging Face `chat_template` (a Jinja
string, as in a model's `tokenizer_config.json`) into the same pieces by rendering a
conversation with a placeholder as every message's content and taking the text each new
message adds. That only works for templates where adding a message appends text and never
changes what was rendered before ("prefix-stable"), and where a role renders the same way
wherever it appears; others are refused at load with a `ValueError`.

Limits of the derived pieces: the system piece assumes the system turn opens the
conversation; a template that rewrites content (e.g. `content | trim`) is rendered as if it
did not; runs of consecutive tool messages are rendered as separate turns (templates such
as Qwen2.5's merge them into one user turn).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
ROLES = ("system", "user", "assistant", "tool")
CONFIG_FILE, JINJA_FILE = "tokenizer_config.json", "chat_template.jinja"

# What a message's content is replaced by when a Jinja template is rendered to find its pieces.
_PLACEHOLDER = "TIDEJAXCONTENTPLACEHOLDER"
# The conversation rendered to find the pieces: every role once, then user and assistant again
# in another place, to check that a role renders the same wherever it appears.
_PROBE = ("system", "user", "assistant", "tool", "user", "assistant")


@dataclass(frozen=True)
class Piece:
    """The text before and after a message's content."""

    before: str
    after: str


@dataclass(frozen=True)
class ChatTemplate:
    """Text around each role's content.

    The generation prompt (what opens a turn the model writes) is the assistant's `before`.
    `preamble` is the text a conversation that does not open with a system turn starts with
    (a default system prompt, say); `None` when the template has no way to render one.
    `open_roles`: roles outside `pieces` are rendered ChatML-style with their own name.
    """

    name: str
    pieces: Mapping[str, Piece]
    preamble: str | None = ""
    open_roles: bool = False

    def piece(self, role: str) -> Piece:
        if role in self.pieces:
            return self.pieces[role]
        if self.open_roles:
            return Piece(f"{IM_START}{role}\n", f"{IM_END}\n")
        raise ValueError(f"chat template {self.name} has no role {role!r}; "
                         f"it knows {sorted(self.pieces)}")


def _chatml() -> ChatTemplate:
    plain = {role: Piece(f"{IM_START}{role}\n", f"{IM_END}\n")
             for role in ("system", "user", "assistant")}
    # A tool result is a user turn wrapping the content, as Qwen2.5 renders one.
    tool = Piece(f"{IM_START}user\n<tool_response>\n", f"\n</tool_response>{IM_END}\n")
    return ChatTemplate("ChatML", {**plain, "tool": tool}, preamble="", open_roles=True)


CHATML = _chatml()


# ------------------------------------------------------------------------------ Jinja
def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=separators)


def _environment():
    """A sandboxed Jinja environment set up the way Hugging Face renders chat templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


@dataclass
class _Renderer:
    name: str
    source: str
    variables: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        from jinja2 import TemplateError
        try:
            self.template = _environment().from_string(self.source)
        except TemplateError as e:
            raise ValueError(f"chat template {self.name} is not a valid Jinja template: {e}"
                             ) from e

    def __call__(self, roles: Sequence[str], add_generation_prompt: bool = False) -> str:
        messages = [{"role": role, "content": _PLACEHOLDER} for role in roles]
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                documents=None, **self.variables)
        except Exception as e:  # a template may raise anything; all mean "cannot render"
            raise ValueError(f"chat template {self.name} failed to render a conversation "
                             f"{list(roles)}: {type(e).__name__}: {e}") from e


def _split(text: str, role: str, name: str) -> Piece:
    count = text.count(_PLACEHOLDER)
    if count != 1:
        raise ValueError(f"chat template {name} renders a {role} message's content {count} "
                         f"times, not once")
    before, after = text.split(_PLACEHOLDER)
    return Piece(before, after)


def _added(longer: str, shorter: str, what: str, name: str) -> str:
    """The text `longer` appends to `shorter`, or a ValueError when it is not an extension."""
    if not longer.startswith(shorter):
        raise ValueError(f"chat template {name} is not prefix-stable: adding {what} changes "
                         f"the text rendered before it, so turns cannot be tokenized one at "
                         f"a time")
    return longer[len(shorter):]


def from_jinja(source: str, name: str = "chat_template",
               variables: Mapping[str, str] | None = None) -> ChatTemplate:
    """Derive each role's pieces from a Jinja chat template (a `ValueError` if impossible).

    `variables` are passed to the template as HF does with special tokens (`bos_token`...).
    """
    render = _Renderer(name, source, dict(variables or {}))
    pieces: dict[str, Piece] = {}
    previous = ""
    for n, role in enumerate(_PROBE):
        text = render(_PROBE[:n + 1])
        piece = _split(_added(text, previous, f"a {role} message", name), role, name)
        if pieces.setdefault(role, piece) != piece:
            raise ValueError(f"chat template {name} renders a {role} message differently "
                             f"depending on where it is ({pieces[role]} vs {piece})")
        previous = text
    for n in (2, 4):  # after a user message, after a tool result
        prompt = _added(render(_PROBE[:n], add_generation_prompt=True), render(_PROBE[:n]),
                        "the generation prompt", name)
        if prompt != pieces["assistant"].before:
            raise ValueError(f"chat template {name}: the generation prompt {prompt!r} differs "
                             f"from an assistant message's opening {pieces['assistant'].before!r}")
    return ChatTemplate(name, pieces, preamble=_preamble(render, pieces["user"]))


def _preamble(render: _Renderer, user: Piece) -> str | None:
    """What the template emits before a first user message beyond that message's own text."""
    try:
        first = _split(render(["user"]), "user", render.name)
    except ValueError:
        return None
    if first.after != user.after or not first.before.endswith(user.before):
        return None
    return first.before[:len(first.before) - len(user.before)]


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a HF checkpoint directory, or None when it ships none.

    `chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template` (a string, or a
    list of named templates of which "default" is used), as in `transformers`. Special tokens
    named in `tokenizer_config.json` (`bos_token`, `eos_token`...) are template variables.
    """
    directory = os.fspath(directory)
    config_path = os.path.join(directory, CONFIG_FILE)
    config: dict = {}
    if os.path.exists(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {config_path}: {e}") from e
    variables = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            variables[key] = value
    jinja_path = os.path.join(directory, JINJA_FILE)
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return from_jinja(f.read(), jinja_path, variables)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{config_path}: chat_template lists {sorted(map(str, named))} "
                             f"but no 'default' template")
        source = named["default"]
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{config_path}: chat_template must be a string, got "
                         f"{type(source).__name__}")
    return from_jinja(source, config_path, variables)
