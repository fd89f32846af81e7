"""Tokenizer: round trip, specials, ChatML generation mask, HF tokenizer.json loading."""

import pytest

from tidejax import models
from tidejax.models.testing import tiny_tokenizer
from tidejax.models.tokenizer import IM_END, IM_START


def test_round_trip_and_specials(tmp_path):
    tok = tiny_tokenizer()
    text = "search[red running shoes] then click[buy now] — ünïcode ok"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == tok.im_start_id and tok.im_end_id in ids  # specials are single tokens
    tok.save(tmp_path / "tokenizer.json")
    again = models.load_tokenizer(tmp_path)
    assert again.encode(text) == tok.encode(text) and again.vocab_size == tok.vocab_size


def test_chat_mask_marks_only_assistant_tokens():
    tok = tiny_tokenizer()
    messages = [
        {"role": "system", "content": "you shop"},
        {"role": "user", "content": "find red shoes"},
        {"role": "assistant", "content": "search[red shoes]"},
        {"role": "user", "content": "results: ..."},
        {"role": "assistant", "content": "click[buy now]"},
    ]
    ids, mask = tok.encode_chat(messages)
    assert len(ids) == len(mask)
    generated = [i for i, m in zip(ids, mask) if m]
    want = (tok.encode("search[red shoes]") + [tok.im_end_id]
            + tok.encode("click[buy now]") + [tok.im_end_id])
    assert generated == want
    # Building turn by turn (as rollouts do) gives the same ids: no re-tokenization drift.
    incremental = []
    for m in messages:
        if m["role"] == "assistant":
            incremental += tok.turn_prefix("assistant") + tok.encode(m["content"])
            incremental += tok.turn_suffix()
        else:
            incremental += tok.turn(m["role"], m["content"])
    assert incremental == ids
    with_prompt, _ = tok.encode_chat(messages[:2], add_generation_prompt=True)
    assert with_prompt[-len(tok.turn_prefix("assistant")):] == tok.turn_prefix("assistant")


def test_train_bpe_rejects_tiny_vocab_and_mismatch():
    with pytest.raises(ValueError, match="vocab_size"):
        models.train_bpe(["abc"], 100)
    from tidejax.models.tokenizer import check_matches_model
    with pytest.raises(ValueError, match="do not belong together"):
        check_matches_model(tiny_tokenizer(), vocab_size=300)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        models.load_tokenizer(tmp_path)
