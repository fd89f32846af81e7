"""Tokenizers: load any HF `tokenizer.json`, train a small byte-level BPE, chat turns.

`encode_chat` builds the token ids of a conversation piece by piece, so the ids of each
assistant turn are exactly what the model produced and the returned mask marks them;
rollouts append observation pieces the same way and never re-tokenize history. The text
around each turn comes from a `ChatTemplate`: the model's own (`load_tokenizer` on a HF
checkpoint directory) or the built-in ChatML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tidejax.models.chat_template import (
    CHATML,
    END_OF_TEXT,
    IM_END,
    IM_START,
    ChatTemplate,
    from_jinja,
    load_chat_template,
)

CHAT_SPECIALS = (END_OF_TEXT, IM_START, IM_END)


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with chat-turn helpers.

    `chat_template`: a `ChatTemplate`, a Jinja chat template string, or None for ChatML.
    An assistant turn must close with `<|im_end|>` (`im_end_id`), the token rollouts stop
    generation on and append when generation hit its cap.
    """

    def __init__(self, hf: HFTokenizer, chat_template: ChatTemplate | str | None = None):
        self.hf = hf
        missing = [t for t in (IM_START, IM_END) if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the ChatML special tokens {missing}")
        self.im_start_id = hf.token_to_id(IM_START)
        self.im_end_id = hf.token_to_id(IM_END)
        eot = hf.token_to_id(END_OF_TEXT)
        self.pad_id = eot if eot is not None else self.im_end_id
        self.eos_ids = (self.im_end_id,) + ((eot,) if eot is not None else ())
        specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        specials.update({t: hf.token_to_id(t) for t in CHAT_SPECIALS
                         if hf.token_to_id(t) is not None})
        self._specials = specials
        self._special_split = re.compile(
            "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
        if isinstance(chat_template, str):
            chat_template = from_jinja(chat_template)
        self.chat_template = chat_template if chat_template is not None else CHATML
        self._piece_ids: dict[str, tuple[list[int], list[int]]] = {}
        closing = self.turn_suffix("assistant")
        if closing[:1] != [self.im_end_id]:
            raise ValueError(
                f"chat template {self.chat_template.name}: an assistant turn must close with "
                f"{IM_END}, the token generation stops on; it closes with "
                f"{self.chat_template.piece('assistant').after!r}")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_template_text(self, text: str) -> list[int]:
        """Template text: each special token (`<|im_start|>`...) is its id, the rest `encode`d."""
        ids: list[int] = []
        for k, part in enumerate(self._special_split.split(text)):
            if k % 2:
                ids.append(self._specials[part])
            elif part:
                ids += self.encode(part)
        return ids

    def _pieces(self, role: str) -> tuple[list[int], list[int]]:
        if role not in self._piece_ids:
            piece = self.chat_template.piece(role)
            self._piece_ids[role] = (self.encode_template_text(piece.before),
                                     self.encode_template_text(piece.after))
        return self._piece_ids[role]

    def turn_prefix(self, role: str) -> list[int]:
        """What opens a turn (`<|im_start|>role\\n` in ChatML); for the assistant, the
        generation prompt."""
        return list(self._pieces(role)[0])

    def turn(self, role: str, content: str) -> list[int]:
        """A whole non-generated turn: prefix, content, suffix (`<|im_end|>\\n` in ChatML).

        Roles: system, user, assistant, tool (a tool result); ChatML takes any role name.
        """
        return self.turn_prefix(role) + self.encode(content) + self.turn_suffix(role)

    def turn_suffix(self, role: str = "assistant") -> list[int]:
        """What closes a turn; for the assistant it starts with `im_end_id`."""
        return list(self._pieces(role)[1])

    def encode_chat(self, messages: Iterable[dict], add_generation_prompt: bool = False
                    ) -> tuple[list[int], list[int]]:
        """Chat ids and a mask that is 1 on tokens the model generated.

        Assistant content and its closing `<|im_end|>` are generated (mask 1); role
        headers, what follows `<|im_end|>` and all other roles are not (mask 0). A
        conversation that does not open with a system turn starts with the template's
        preamble (e.g. a default system prompt; nothing in ChatML).
        """
        ids: list[int] = []
        mask: list[int] = []

        def add(piece: list[int], generated: int = 0) -> None:
            ids.extend(piece)
            mask.extend([generated] * len(piece))

        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"message {i} needs string 'role' and 'content'")
            if i == 0 and role != "system":
                preamble = self.chat_template.preamble
                if preamble is None:
                    raise ValueError(f"chat template {self.chat_template.name} needs the "
                                     f"conversation to open with a system message")
                add(self.encode_template_text(preamble))
            generated = int(role == "assistant")
            add(self.turn_prefix(role))
            add(self.encode(content), generated)
            suffix = self.turn_suffix(role)
            add(suffix[:generated], generated)  # the assistant's closing `<|im_end|>`
            add(suffix[generated:])
        if add_generation_prompt:
            add(self.turn_prefix("assistant"))
        return ids, mask

    def save(self, path: str | os.PathLike) -> None:
        self.hf.save(os.fspath(path))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `tokenizer.json` (a file, or a directory holding one).

    In a directory, the model's chat template (`tokenizer_config.json`'s `chat_template`, or
    `chat_template.jinja`) is used when there is one, ChatML otherwise; a template that
    cannot be tokenized turn by turn raises `ValueError` naming its file.
    """
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else None
    if directory is not None:
        path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    template = load_chat_template(directory) if directory is not None else None
    return Tokenizer(HFTokenizer.from_file(path), chat_template=template)


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
