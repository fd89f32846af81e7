"""Token-in/token-out episode record for one multi-turn task.

Every id the model generated is stored exactly as sampled (with its behaviour log-prob
and policy version); every observation is tokenized once, when it arrives, and appended.
The trainer therefore sees the very ids the rollout produced: no decode/re-encode of the
history ever happens, so there is no tokenization drift across turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tidejax.models.tokenizer import Tokenizer


@dataclasses.dataclass
class EpisodeTokens:
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    behaviour_logp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0

    def extend_context(self, ids: list[int], version: int = 0) -> None:
        """Tokens the model did not generate (system, observations, role headers)."""
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.behaviour_logp += [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def extend_generated(self, ids: list[int], logps: list[float], version: int) -> None:
        if len(ids) != len(logps):
            raise ValueError(f"{len(ids)} generated ids but {len(logps)} log-probs")
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.behaviour_logp += list(logps)
        self.versions += [version] * len(ids)
        self.turns += 1

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    def min_generated_version(self) -> int:
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else 0

    def __len__(self) -> int:
        return len(self.tokens)


def open_episode(tokenizer: Tokenizer, system: str, first_observation: str,
                 messages: Sequence[Mapping[str, str]] = (), role: str = "user"
                 ) -> EpisodeTokens:
    """The prompt: a system turn (the task's own system message, else `system`), the
    task's other prompt messages (a dataset row's, as context), the first observation as
    a `role` turn (left out when empty and the messages already prompt), then the
    assistant header."""
    messages = list(messages)
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    ids = tokenizer.turn("system", system)
    for message in messages:
        ids += tokenizer.turn(message["role"], message["content"])
    if first_observation or not messages:
        ids += tokenizer.turn(role, first_observation)
    ep = EpisodeTokens()
    ep.extend_context(ids + tokenizer.turn_prefix("assistant"))
    return ep


def close_action(tokenizer: Tokenizer, ep: EpisodeTokens, generated: list[int]) -> None:
    """After a generated action: close the turn as the chat template does (`<|im_end|>`,
    then what follows it: `\\n` in ChatML).

    The sampled `<|im_end|>` (if any) is already in `generated`; when generation stopped
    on the token cap instead, the closing token is appended as context (mask 0).
    """
    if not generated or generated[-1] not in tokenizer.eos_ids:
        ep.extend_context([tokenizer.im_end_id])
    ep.extend_context(tokenizer.turn_suffix("assistant")[1:])


def observation_ids(tokenizer: Tokenizer, observation: str, role: str = "user") -> list[int]:
    """An observation turn (a "user" or a "tool" turn) plus the next assistant header."""
    return tokenizer.turn(role, observation) + tokenizer.turn_prefix("assistant")


def add_observation(tokenizer: Tokenizer, ep: EpisodeTokens, observation: str,
                    role: str = "user") -> list[int]:
    """Append an observation turn and the next assistant header; returns the new ids."""
    ids = observation_ids(tokenizer, observation, role)
    ep.extend_context(ids)
    return ids


def action_text(tokenizer: Tokenizer, generated: list[int]) -> str:
    """The env sees the decoded action without special tokens, stripped."""
    return tokenizer.decode(generated, skip_special_tokens=True).strip()
