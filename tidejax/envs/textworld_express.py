"""TextWorld-Express as a tidejax env: an adapter for a real third-party env (optional).

    pip install 'tidejax[textworld]'      # textworld-express; needs a Java runtime
    env_type = "tidejax.envs.textworld_express:TextWorldExpressEnv"
    [env]
    game = "coin"

Goal `i` of a split is the game the library generates from the i-th seed of its fold
(train, dev for "eval", test), wrapped modulo the fold's size. The first observation is
the task description and the room; `info["admissible_actions"]` lists the valid actions;
the library's gold path is the expert. Reward rule: the game's score is paid on the last
step (the rollout runtime reads an episode's return from its last step); `won` is the
game's own success flag.

Each library instance runs a JVM (seconds to start), so instances are kept in a free list
per settings and reused across episodes; one is only ever used by one episode at a time
(the library is not thread-safe). The free list's lock is taken from the pool's worker
threads; it guards only the list.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from tidejax.envs.protocol import task_from_options

FOLDS = {"train": "train", "eval": "dev", "test": "test"}


@dataclasses.dataclass(frozen=True)
class TextWorldExpressConfig:
    game: str = "coin"  # coin, cookingworld, twc, mapreader, arithmetic, sorting, ...
    game_params: str = ""  # the library's parameter string, e.g. "numLocations=3"
    step_limit: int = 100  # the library's own cap (the task's max_turns also applies)

    def __post_init__(self) -> None:
        if not self.game:
            raise ValueError("game must be a non-empty game name")
        if self.step_limit < 1:
            raise ValueError(f"step_limit must be >= 1, got {self.step_limit}")


_FREE: dict[TextWorldExpressConfig, list[Any]] = {}
_FREE_LOCK = threading.Lock()


def _take_instance(config: TextWorldExpressConfig) -> Any:
    with _FREE_LOCK:
        free = _FREE.get(config)
        if free:
            return free.pop()
    try:
        from textworld_express import TextWorldExpressEnv as Library
    except ImportError as e:
        raise RuntimeError("TextWorld-Express is not installed: pip install "
                           "'tidejax[textworld]' (it also needs a Java runtime)") from e
    instance = Library(envStepLimit=config.step_limit)
    instance.load(config.game, config.game_params)  # a bad game name raises ValueError here
    instance.seeds = {"train": list(instance.getValidSeedsTrain()),
                      "dev": list(instance.getValidSeedsDev()),
                      "test": list(instance.getValidSeedsTest())}
    return instance


def _give_back(config: TextWorldExpressConfig, instance: Any) -> None:
    with _FREE_LOCK:
        _FREE.setdefault(config, []).append(instance)


class GoldPathExpert:
    """Plays the library's gold action sequence for the current game."""

    def __init__(self, env: TextWorldExpressEnv):
        self.env = env

    def act(self, obs: str, info: dict[str, Any]) -> str:
        gold = self.env.gold
        return gold[self.env.turn] if self.env.turn < len(gold) else "look around"


class TextWorldExpressEnv:
    """One TextWorld-Express episode at a time, on a reused library instance."""

    split_sizes = {"train": 1000, "eval": 200, "test": 200}
    max_turns = 60  # coin's gold paths run to 30+ actions (it explores room by room)
    action_format = ("You play a text game. Each turn, write exactly one action from the "
                     "list of valid actions, e.g. 'move north' or 'take coin'.")
    config_class = TextWorldExpressConfig
    expert = GoldPathExpert

    def __init__(self, config: TextWorldExpressConfig | None = None):
        self.config = config or TextWorldExpressConfig()
        self._lib: Any = None
        self.gold: list[str] = []
        self.turn, self.turn_cap = 0, self.max_turns

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None):
        task = task_from_options(options)
        if task is None:
            raise ValueError("TextWorldExpressEnv.reset needs options={'task': Task}")
        if self._lib is None:
            self._lib = _take_instance(self.config)
        fold = FOLDS[task.split]
        seeds = self._lib.seeds[fold]
        game_seed = seeds[task.goal_index % len(seeds)]
        obs, infos = self._lib.reset(seed=game_seed, gameFold=fold, generateGoldPath=True)
        self.gold = list(self._lib.getGoldActionSequence())
        self.turn, self.turn_cap = 0, task.max_turns
        text = f"{self._lib.getTaskDescription()}\n\n{obs}"
        return text, self._info(infos, won=False)

    def step(self, action: str):
        if self._lib is None:
            raise RuntimeError("call reset() first")
        obs, _, done, infos = self._lib.step(action.strip())
        self.turn += 1
        won = bool(infos.get("tasksuccess"))
        terminated = bool(done)
        truncated = not terminated and self.turn >= self.turn_cap
        reward = float(infos.get("score", 0.0)) if terminated or truncated else 0.0
        return obs, reward, terminated, truncated, self._info(infos, won=won)

    @staticmethod
    def _info(infos: dict[str, Any], won: bool) -> dict[str, Any]:
        return {"admissible_actions": [str(a) for a in infos.get("validActions", [])],
                "score": float(infos.get("score", 0.0)), "won": won}

    def close(self) -> None:
        lib, self._lib = self._lib, None
        if lib is not None:
            _give_back(self.config, lib)
