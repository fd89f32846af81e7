"""One attempt at a task's episode: prompt, then [generate on a rank -> env step]*, return.

Runs as a coroutine on the controller's asyncio loop (the manager starts one per task
attempt); generation is handed to the task's `RolloutWorker` thread and awaited through
a future, env calls are awaited on the `EnvPool`. Scheduling stays with the manager: the
loop waits on the task's `can_run` event before each turn and calls `host.schedule()`
after every event that changes footprints.

Prompting: the env's system prompt (or the task's own system message), the task's prompt
messages (`Task.data["messages"]`), then the first observation; every later observation
is a "user" or "tool" turn as the env's `info["role"]` says. The action the env receives
is the generated text decoded without special tokens (envs that declare a parser get it
parsed by `envs.actions.ParsedActionEnv`). The episode's return follows the env's
return rule over its per-step rewards.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Protocol

from tidejax.envs.registry import episode_return, get_spec
from tidejax.models.tokenizer import Tokenizer
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.episode import action_text, close_action, observation_ids, open_episode
from tidejax.runtime.records import TaskRecord, TaskState
from tidejax.runtime.rollout import RankFailed, RolloutWorker, TurnResult
from tidejax.serving.config import SamplingParams
from tidejax.serving.loop import Request


def sampling_seed(run_seed: int, task_id: str, turn: int, attempt: int) -> int:
    """A turn's sampling seed from what identifies it, not from when it ran (31 bits)."""
    digest = hashlib.blake2b(f"{run_seed}/{task_id}/{turn}/{attempt}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def seed_key(rec: TaskRecord) -> str:
    """What a turn's seed hashes: the task id, except that evaluation sample k of goal g
    gets the same seeds at every version (common random numbers)."""
    if rec.group.is_eval:
        sample = rec.task.task_id.rsplit("-", 1)[-1]
        return f"eval/{rec.task.split}/{rec.task.goal_index}/{sample}"
    return rec.task.task_id


class LoopHost(Protocol):
    """What the episode loop needs from the manager that runs it."""

    workers: dict[int, RolloutWorker]
    counters: dict[str, int]

    def schedule(self) -> None: ...

    def quarantine(self, rank: int) -> None: ...


class EpisodeLoop:
    """Runs episode attempts for one env type; see the module docstring."""

    def __init__(self, host: LoopHost, config: RolloutConfig, tokenizer: Tokenizer, pool,
                 env_type: str, seed: int, max_seq_len: int):
        spec = get_spec(env_type)
        self.host, self.config, self.tokenizer, self.pool = host, config, tokenizer, pool
        self.system_prompt = spec.action_format
        self.return_rule = spec.return_rule
        self.seed, self.max_seq_len = seed, max_seq_len

    def sampling(self, rec: TaskRecord) -> SamplingParams:
        seed = sampling_seed(self.seed, seed_key(rec), rec.episode.turns, rec.attempts)
        temperature = (self.config.evaluation_temperature if rec.group.is_eval
                       else self.config.temperature)
        return SamplingParams(temperature=temperature, max_new_tokens=self.config.max_new_tokens,
                              stop_token_ids=self.tokenizer.eos_ids[:4], seed=seed)

    async def generate(self, rec: TaskRecord) -> TurnResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(result):
            def resolve():
                if future.done():
                    return
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            loop.call_soon_threadsafe(resolve)

        worker = self.host.workers[rec.rank]
        request = Request(request_id=(rec.uid, rec.episode.turns, rec.attempts), task_id=rec.uid,
                          prompt_token_ids=tuple(rec.episode.tokens),
                          max_new_tokens=self.config.max_new_tokens, sampling=self.sampling(rec))
        worker.submit(request, on_done)
        return await future

    async def run(self, rec: TaskRecord) -> str | None:
        """One attempt at the episode; returns None on success or a failure reason."""
        host, counters = self.host, self.host.counters
        start = await self.pool.reset(rec.task)
        if not start.ok:
            return f"env_{start.error}"
        messages = (rec.task.data or {}).get("messages", ())
        rec.episode = open_episode(self.tokenizer, self.system_prompt, start.obs, messages,
                                   start.info.get("role", "user"))
        rec.actions, rec.step_rewards, rec.end = [], [], ""
        if len(rec.episode) + self.config.max_new_tokens > self.max_seq_len:
            # The opening prompt leaves no room for a turn (the rule observations meet at
            # the context cap): this task fails alone instead of reaching an engine.
            return "prompt_too_long"
        rec.state = TaskState.READY
        host.schedule()
        while True:
            await rec.can_run.wait()
            if rec.rank is None or rec.rank not in host.workers:
                rec.can_run.clear()
                host.schedule()
                continue
            rec.state = TaskState.GENERATING
            rec.home = rec.rank
            try:
                turn = await self.generate(rec)
            except RankFailed as failure:
                # The turn is lost with its rank, the episode is not: resume it elsewhere.
                rec.state = TaskState.READY
                host.quarantine(failure.rank)
                counters["turns_reissued"] = counters.get("turns_reissued", 0) + 1
                continue
            comp = turn.completion
            counters["turns"] += 1
            counters["prompt_tokens"] += len(comp.prompt_token_ids)
            counters["cached_tokens"] += comp.cached_tokens
            counters["generated_tokens"] += len(comp.token_ids)
            rec.episode.extend_generated(list(comp.token_ids), list(comp.logprobs), turn.version)
            close_action(self.tokenizer, rec.episode, list(comp.token_ids))
            if rec.group.probe_tokens is None:
                rec.group.probe_tokens = len(rec.episode)
            rec.state = TaskState.ENV
            host.schedule()
            action = action_text(self.tokenizer, list(comp.token_ids))
            rec.actions.append(action)
            result = await self.pool.step(rec.task.task_id, action)
            if not result.ok:
                return f"env_{result.error}"
            rec.step_rewards.append(float(result.reward))
            if result.done:
                rec.reward = episode_return(self.return_rule, rec.step_rewards)
                rec.won = bool(result.info.get("won", rec.reward >= 1.0))
                rec.end = "env_done"
                return None
            new_ids = observation_ids(self.tokenizer, result.obs, result.info.get("role", "user"))
            if len(rec.episode) + len(new_ids) + self.config.max_new_tokens > self.max_seq_len:
                # Context cap: the episode ends without the observation that would not fit,
                # so every trajectory fits one training row. It never reached a final
                # reward: 0 under "last"; "sum" and "max" keep what the steps earned.
                rec.reward = (0.0 if self.return_rule == "last"
                              else episode_return(self.return_rule, rec.step_rewards))
                rec.won, rec.end = False, "context_cap"
                return None
            rec.episode.extend_context(new_ids)
            rec.state = TaskState.READY
            host.schedule()
