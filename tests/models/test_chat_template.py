"""Chat templates: ChatML ids unchanged, Jinja templates piece by piece, tool turns, fallbacks."""

import json
import os

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tidejax import models
from tidejax.models.chat_template import CHATML, IM_END, IM_START
from tidejax.models.testing import tiny_tokenizer
from tidejax.models.tokenizer import Tokenizer, load_tokenizer, train_bpe

WARM_START_TOKENIZER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tidejax", "warm_starts", "webshop-tiny", "tokenizer.json")

CONTENTS = [
    "", "\n", "hi", "search[red shoes]\n", "  leading spaces and\ttabs ",
    "line one\nline two\n\nline four", "ünïcödé — 日本語 🙂", "user\n", "assistant",
    "system\nuser\nassistant\n", "<|im_start|>assistant\nfake<|im_end|>",
    "\n<tool_response>\nx\n</tool_response>", "click[buy now]<|im_end|>",
]
ROLES = ["system", "user", "assistant", "observation"]  # `tool` changes on purpose


# -------------------------------------------------- frozen copy of the ChatML code before templates
def old_turn_prefix(tok, role):
    return [tok.im_start_id] + tok.encode(f"{role}\n")


def old_turn_suffix(tok):
    return [tok.im_end_id] + tok.encode("\n")


def old_turn(tok, role, content):
    return old_turn_prefix(tok, role) + tok.encode(content) + old_turn_suffix(tok)


def old_encode_chat(tok, messages, add_generation_prompt=False):
    ids, mask = [], []
    for message in messages:
        role, content = message["role"], message["content"]
        prefix = old_turn_prefix(tok, role)
        ids += prefix
        mask += [0] * len(prefix)
        body = tok.encode(content) + [tok.im_end_id]
        ids += body
        mask += [int(role == "assistant")] * len(body)
        newline = tok.encode("\n")
        ids += newline
        mask += [0] * len(newline)
    if add_generation_prompt:
        prefix = old_turn_prefix(tok, "assistant")
        ids += prefix
        mask += [0] * len(prefix)
    return ids, mask


def small_bpe():
    return train_bpe(["the user asks, the assistant answers\n", "system prompt: shop well",
                      "search[red shoes] click[buy now] ünïcode\n\n"] * 3, 320)


def qwen_like(tok):
    """The same vocabulary with Qwen2's normalizer and pre-tokenizer (regex split, then bytes)."""
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    hf = HFTokenizer.from_str(tok.hf.to_str())
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return Tokenizer(hf)


TOKENIZERS = {"tiny": tiny_tokenizer, "small_bpe": small_bpe,
              "qwen_like": lambda: qwen_like(small_bpe()),
              "shipped_warm_start": lambda: load_tokenizer(WARM_START_TOKENIZER)}


@pytest.mark.parametrize("name", TOKENIZERS)
def test_chatml_ids_identical_to_before_templates(name):
    tok = TOKENIZERS[name]()
    assert tok.chat_template is CHATML
    for role in ROLES:
        assert tok.turn_prefix(role) == old_turn_prefix(tok, role)
        for content in CONTENTS:
            assert tok.turn(role, content) == old_turn(tok, role, content)
    assert tok.turn_suffix() == old_turn_suffix(tok)
    assert tok.turn_suffix("assistant") == old_turn_suffix(tok)
    messages = [{"role": r, "content": c} for c in CONTENTS for r in ROLES]
    for start in (0, 1):  # opening with a system turn, and not
        for prompt in (False, True):
            got = tok.encode_chat(messages[start:], add_generation_prompt=prompt)
            assert got == old_encode_chat(tok, messages[start:], prompt)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ROLES), st.text(max_size=30)), max_size=6),
       st.booleans())
def test_chatml_ids_identical_on_random_text(turns, prompt):
    tok = tiny_tokenizer()
    messages = [{"role": r, "content": c} for r, c in turns]
    assert tok.encode_chat(messages, prompt) == old_encode_chat(tok, messages, prompt)
    for role, content in turns:
        assert tok.turn(role, content) == old_turn(tok, role, content)


@pytest.mark.parametrize("name", ["small_bpe", "qwen_like", "shipped_warm_start"])
def test_special_tokens_in_template_text_are_single_ids(name):
    tok = TOKENIZERS[name]()
    for text, head, rest in [(f"{IM_START}user\n", tok.im_start_id, "user\n"),
                             (f"{IM_END}\n", tok.im_end_id, "\n")]:
        assert tok.encode(text) == [head] + tok.encode(rest)  # the library splits them too
        assert tok.encode_template_text(text) == [head] + tok.encode(rest)
    tail = f"\n</tool_response>{IM_END}\n"
    assert tok.encode_template_text(tail) == tok.encode(tail)


# ---------------------------------------------------------------------- Jinja templates
# Written for these tests with Qwen2.5's semantics: ChatML turns, a default system prompt when
# the conversation does not open with one, tool results as user turns in <tool_response>.
QWEN_LIKE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system_text = 'You are a careful shopping assistant.' %}
    {%- set rest = messages %}
{%- endif %}
{{- bos_token -}}
<|im_start|>system
{{ system_text }}<|im_end|>
{% for message in rest %}
    {%- if message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
    {%- elif message.role in ['user', 'assistant'] %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {%- else %}
        {{- raise_exception('unsupported role ' + message.role) }}
    {%- endif %}

{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CONVERSATION = [
    {"role": "system", "content": "You shop.\nBe brief."},
    {"role": "user", "content": "find red shoes — ünïcode\n"},
    {"role": "assistant", "content": "search[red shoes]"},
    {"role": "tool", "content": "[B0001] red shoes $30\nuser\n<|im_start|>x"},
    {"role": "user", "content": "buy the cheapest"},
]


def hf_render(source, messages, add_generation_prompt=False, **variables):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages,
                                          add_generation_prompt=add_generation_prompt,
                                          **variables)


def checkpoint_dir(tmp_path, chat_template=None, jinja_file=None, **config):
    path = tmp_path / "ckpt"
    path.mkdir(exist_ok=True)
    small_bpe().save(path / "tokenizer.json")
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (path / "chat_template.jinja").write_text(jinja_file)
    return path


def test_jinja_template_pieces_reproduce_the_full_render(tmp_path):
    tok = load_tokenizer(checkpoint_dir(tmp_path, QWEN_LIKE_TEMPLATE, bos_token="<|endoftext|>"))
    assert tok.chat_template is not CHATML
    for prompt in (False, True):
        ids, mask = tok.encode_chat(CONVERSATION, add_generation_prompt=prompt)
        want = hf_render(QWEN_LIKE_TEMPLATE, CONVERSATION, prompt, bos_token="<|endoftext|>")
        assert tok.decode(ids, skip_special_tokens=False) == want
    # Turn by turn, as rollouts build episodes, gives the same ids; content ids are encode().
    incremental = [tok.turn(m["role"], m["content"]) for m in CONVERSATION]
    assert sum(incremental, []) + tok.turn_prefix("assistant") == ids
    tool = tok.turn("tool", CONVERSATION[3]["content"])
    inner = tok.encode(CONVERSATION[3]["content"])
    assert any(tool[i:i + len(inner)] == inner for i in range(len(tool)))
    assert [i for i, m in zip(ids, mask) if m] == tok.encode("search[red shoes]") + [tok.im_end_id]
    # Without a system turn the template's default system prompt comes first.
    ids, _ = tok.encode_chat(CONVERSATION[1:3])
    assert tok.decode(ids, skip_special_tokens=False) == hf_render(
        QWEN_LIKE_TEMPLATE, CONVERSATION[1:3], bos_token="<|endoftext|>")


def test_qwen_like_template_gives_chatml_ids_after_a_system_turn(tmp_path):
    tok = load_tokenizer(checkpoint_dir(tmp_path, QWEN_LIKE_TEMPLATE))  # no bos_token: ""
    chatml = Tokenizer(tok.hf)
    assert tok.encode_chat(CONVERSATION, True) == chatml.encode_chat(CONVERSATION, True)
    assert Tokenizer(tok.hf, chat_template=QWEN_LIKE_TEMPLATE).turn("tool", "x") == \
        chatml.turn("tool", "x")


def test_chat_template_jinja_file_wins(tmp_path):
    """As in transformers: `chat_template.jinja` beside the config overrides its field."""
    path = checkpoint_dir(tmp_path, "{{ raise_exception('not this one') }}",
                          jinja_file=QWEN_LIKE_TEMPLATE)
    tok = load_tokenizer(path)
    assert tok.chat_template.name == os.path.join(path, "chat_template.jinja")
    assert tok.encode_chat(CONVERSATION) == Tokenizer(tok.hf).encode_chat(CONVERSATION)


@pytest.mark.parametrize("source,match", [
    # Renders the message count at the top: adding a message rewrites earlier text.
    ("{{ messages | length }} messages\n{% for m in messages %}<|im_start|>{{ m.role }}\n"
     "{{ m.content }}<|im_end|>\n{% endfor %}", "prefix-stable"),
    # No tool role.
    ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
     "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "tool"),
    # An assistant turn that does not close with <|im_end|>.
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
     "{% if m.role == 'assistant' %}<|endoftext|>{% else %}<|im_end|>{% endif %}\n"
     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", IM_END),
    ("{% for m in messages %}{{ m.content }}", "not a valid Jinja template"),
])
def test_unusable_templates_fail_at_load_naming_the_file(tmp_path, source, match):
    with pytest.raises(ValueError, match=match) as info:
        load_tokenizer(checkpoint_dir(tmp_path, source))
    assert "tokenizer_config.json" in str(info.value)


# -------------------------------------------------------------------------- ChatML tool
def test_chatml_tool_turn_is_a_wrapped_user_turn():
    tok = tiny_tokenizer()
    content = "results:\n[B0001] red shoes"
    ids = tok.turn("tool", content)
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"{IM_START}user\n<tool_response>\n{content}\n</tool_response>{IM_END}\n")
    prefix = tok.turn_prefix("tool")
    assert ids == prefix + tok.encode(content) + tok.turn_suffix("tool")
    assert prefix == tok.turn_prefix("user") + tok.encode("<tool_response>\n")
    ids, mask = tok.encode_chat([{"role": "system", "content": "s"},
                                 {"role": "tool", "content": content}])
    assert not any(mask) and ids == tok.turn("system", "s") + tok.turn("tool", content)


# ------------------------------------------------------------------------------ fallbacks
def test_config_without_chat_template_falls_back_to_chatml(tmp_path):
    path = checkpoint_dir(tmp_path, bos_token=None, eos_token="<|im_end|>")
    tok = load_tokenizer(path)
    assert tok.chat_template is CHATML
    messages = CONVERSATION[:3]
    assert tok.encode_chat(messages, True) == old_encode_chat(tok, messages, True)
    assert load_tokenizer(path / "tokenizer.json").chat_template is CHATML


def test_jinja_template_rejects_unknown_roles(tmp_path):
    tok = load_tokenizer(checkpoint_dir(tmp_path, QWEN_LIKE_TEMPLATE))
    with pytest.raises(ValueError, match="observation"):
        tok.turn("observation", "x")
    assert isinstance(tok.chat_template, models.ChatTemplate)
