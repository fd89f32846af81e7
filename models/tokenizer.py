"""Tokenizers: load any HF `tokenizer.json`, train a small byte-level BPE, ChatML turns.

`encode_chat` builds the token ids of a conversation piece by piece, so the ids of each
assistant turn are exactly what the model produced and the returned mask marks them;
rollouts append observation pieces the same way and never re-tokenize history.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_SPECIALS = (END_OF_TEXT, IM_START, IM_END)


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with ChatML helpers."""

    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        missing = [t for t in (IM_START, IM_END) if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the ChatML special tokens {missing}")
        self.im_start_id = hf.token_to_id(IM_START)
        self.im_end_id = hf.token_to_id(IM_END)
        eot = hf.token_to_id(END_OF_TEXT)
        self.pad_id = eot if eot is not None else self.im_end_id
        self.eos_ids = (self.im_end_id,) + ((eot,) if eot is not None else ())

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def turn_prefix(self, role: str) -> list[int]:
        """`<|im_start|>role\\n`: what opens a turn (the generation prompt for the assistant)."""
        return [self.im_start_id] + self.encode(f"{role}\n")

    def turn(self, role: str, content: str) -> list[int]:
        """A whole non-generated turn: prefix, content, `<|im_end|>\\n`."""
        return self.turn_prefix(role) + self.encode(content) + self.turn_suffix()

    def turn_suffix(self) -> list[int]:
        return [self.im_end_id] + self.encode("\n")

    def encode_chat(self, messages: Iterable[dict], add_generation_prompt: bool = False
                    ) -> tuple[list[int], list[int]]:
        """ChatML ids and a mask that is 1 on tokens the model generated.

        Assistant content and its closing `<|im_end|>` are generated (mask 1); role
        headers, the newline after `<|im_end|>` and all other roles are not (mask 0).
        """
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"message {i} needs string 'role' and 'content'")
            prefix = self.turn_prefix(role)
            ids += prefix
            mask += [0] * len(prefix)
            body = self.encode(content) + [self.im_end_id]
            ids += body
            mask += [int(role == "assistant")] * len(body)
            newline = self.encode("\n")
            ids += newline
            mask += [0] * len(newline)
        if add_generation_prompt:
            prefix = self.turn_prefix("assistant")
            ids += prefix
            mask += [0] * len(prefix)
        return ids, mask

    def save(self, path: str | os.PathLike) -> None:
        self.hf.save(os.fspath(path))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `tokenizer.json` (a file, or a directory holding one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return Tokenizer(HFTokenizer.from_file(path))


def train_bpe(texts: Iterable[str], vocab_size: int,
              special_tokens: Sequence[str] = CHAT_SPECIALS,
              added_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE (GPT-2/Qwen style) trained on `texts`, ChatML specials included.

    `added_tokens` become single ordinary tokens after the `vocab_size` learned ones (for
    domain identifiers such as product ids, which BPE would otherwise split into many
    pieces); they decode like normal text.
    """
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be >= {256 + len(special_tokens)} for a byte-level "
                         f"BPE, got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    if added_tokens:
        hf.add_tokens([AddedToken(t, normalized=False) for t in added_tokens])
    return Tokenizer(hf)


def check_matches_model(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Fail early when token ids could index past the model's embedding table."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {vocab_size}: they do not belong together")
