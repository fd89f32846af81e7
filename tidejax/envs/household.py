"""A small household text game in the spirit of ALFWorld (Shridhar et al., 2021).

A scene is one room (kitchen, bathroom, living room or bedroom) with numbered
receptacles ("cabinet 2", "countertop 1"); openable ones start closed and hide their
contents. Goals are ALFWorld's task families: put an object somewhere, or first clean,
heat or cool it, or put two of them. The agent holds one object at a time. Actions:

    go to <recep>    open <recep>    close <recep>    take <obj> from <recep>
    put <obj> in/on <recep>    clean|heat|cool <obj> with <sinkbasin|microwave|fridge>
    examine <thing>  look  inventory

An action that does not apply prints "Nothing happens." and changes nothing. The
reward is 1 when the goal holds (terminated) and 0 otherwise. Horizons are longer than
WebShop's: finding an object means opening cabinets and drawers one by one.

Scenes are generated from (seed, split, goal index), so goals need no stored data.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from tidejax.envs.latency_spec import HOUSEHOLD_LATENCY
from tidejax.envs.protocol import task_from_options
from tidejax.envs.registry import EnvSpec, register

# calibration.md env.alfworld.max_turns: 50 (verl-agent), 15-20 (AgentBench/TideRL); 30
# sits between them and above WebShop's 20, so this type is the longer-horizon regime.
DEFAULT_MAX_TURNS = 30
SPLIT_SIZES = {"test": 200, "eval": 400, "train": 5000}
_SPLIT_CODE = {"train": 0, "eval": 1, "test": 2}

# kind -> (preposition, openable)
# fmt: off
RECEPTACLES: dict[str, tuple[str, bool]] = {
    "cabinet": ("in", True), "drawer": ("in", True), "fridge": ("in", True),
    "microwave": ("in", True), "countertop": ("on", False), "sinkbasin": ("in", False),
    "stoveburner": ("on", False), "diningtable": ("on", False), "garbagecan": ("in", False),
    "shelf": ("on", False), "coffeemachine": ("on", False), "towelholder": ("on", False),
    "toilet": ("on", False), "bathtubbasin": ("in", False), "sofa": ("on", False),
    "armchair": ("on", False), "coffeetable": ("on", False), "sidetable": ("on", False),
    "tvstand": ("on", False), "bed": ("on", False), "desk": ("on", False),
    "dresser": ("on", False), "laundryhamper": ("in", False),
}
# fmt: on
APPLIANCE = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}


@dataclasses.dataclass(frozen=True)
class RoomType:
    receptacles: tuple[tuple[str, int], ...]  # (kind, how many)
    objects: dict[str, tuple[str, ...]]  # object kind -> where it may start, likeliest first
    targets: tuple[str, ...]  # receptacle kinds goals put things in/on
    cleanable: frozenset[str] = frozenset()
    heatable: frozenset[str] = frozenset()
    coolable: frozenset[str] = frozenset()


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# fmt: off
ROOMS: dict[str, RoomType] = {
    "kitchen": RoomType(
        receptacles=(("cabinet", 4), ("drawer", 3), ("countertop", 2), ("fridge", 1),
                     ("microwave", 1), ("sinkbasin", 1), ("stoveburner", 2),
                     ("diningtable", 1), ("garbagecan", 1), ("shelf", 1),
                     ("coffeemachine", 1)),
        objects={
            "mug": ("countertop", "coffeemachine", "cabinet", "diningtable", "sinkbasin"),
            "cup": ("countertop", "cabinet", "diningtable", "shelf"),
            "bowl": ("cabinet", "countertop", "diningtable", "shelf"),
            "plate": ("cabinet", "countertop", "diningtable"),
            "apple": ("countertop", "diningtable", "fridge", "garbagecan"),
            "egg": ("fridge", "countertop", "diningtable"),
            "potato": ("fridge", "countertop", "diningtable", "garbagecan"),
            "tomato": ("fridge", "countertop", "diningtable"),
            "bread": ("countertop", "diningtable", "fridge"),
            "lettuce": ("fridge", "countertop", "diningtable"),
            "knife": ("countertop", "drawer", "diningtable"),
            "fork": ("drawer", "countertop", "diningtable"),
            "spoon": ("drawer", "countertop", "diningtable"),
            "pan": ("stoveburner", "countertop", "cabinet"),
            "pot": ("stoveburner", "countertop", "cabinet"),
            "spatula": ("drawer", "countertop"),
            "saltshaker": ("countertop", "shelf", "cabinet"),
            "winebottle": ("countertop", "fridge", "cabinet"),
        },
        targets=("countertop", "diningtable", "cabinet", "shelf", "drawer", "fridge"),
        cleanable=_words("mug cup bowl plate apple potato tomato lettuce knife fork spoon pan "
                         "pot spatula"),
        heatable=_words("mug cup plate apple egg potato tomato bread"),
        coolable=_words("mug cup bowl plate apple potato tomato bread lettuce pan pot "
                        "winebottle"),
    ),
    "bathroom": RoomType(
        receptacles=(("cabinet", 3), ("drawer", 2), ("countertop", 1), ("sinkbasin", 1),
                     ("shelf", 1), ("towelholder", 1), ("toilet", 1), ("garbagecan", 1),
                     ("bathtubbasin", 1)),
        objects={
            "soapbar": ("countertop", "sinkbasin", "bathtubbasin", "cabinet", "toilet"),
            "cloth": ("countertop", "cabinet", "drawer", "bathtubbasin"),
            "towel": ("towelholder", "countertop", "cabinet"),
            "toiletpaper": ("toilet", "cabinet", "shelf", "countertop"),
            "spraybottle": ("cabinet", "countertop", "toilet", "shelf"),
            "candle": ("countertop", "shelf", "cabinet", "toilet"),
            "soapbottle": ("countertop", "shelf", "cabinet"),
        },
        targets=("cabinet", "countertop", "shelf", "drawer", "garbagecan", "toilet"),
        cleanable=_words("soapbar cloth"),
    ),
    "livingroom": RoomType(
        receptacles=(("sofa", 1), ("armchair", 1), ("coffeetable", 1), ("sidetable", 2),
                     ("drawer", 3), ("shelf", 2), ("tvstand", 1), ("garbagecan", 1),
                     ("cabinet", 2)),
        objects={
            "remotecontrol": ("sofa", "coffeetable", "armchair", "sidetable", "tvstand"),
            "book": ("shelf", "coffeetable", "sidetable", "sofa"),
            "keychain": ("coffeetable", "sidetable", "drawer", "tvstand"),
            "pillow": ("sofa", "armchair"),
            "newspaper": ("coffeetable", "sofa", "sidetable", "armchair"),
            "vase": ("shelf", "sidetable", "tvstand", "cabinet"),
            "creditcard": ("coffeetable", "sidetable", "drawer", "armchair"),
            "statue": ("shelf", "sidetable", "coffeetable", "cabinet"),
            "laptop": ("sofa", "coffeetable", "sidetable"),
        },
        targets=("sofa", "armchair", "coffeetable", "sidetable", "drawer", "shelf", "cabinet"),
    ),
    "bedroom": RoomType(
        receptacles=(("bed", 1), ("desk", 1), ("drawer", 4), ("dresser", 1), ("shelf", 2),
                     ("sidetable", 1), ("garbagecan", 1), ("laundryhamper", 1)),
        objects={
            "book": ("shelf", "desk", "sidetable", "bed"),
            "cellphone": ("bed", "desk", "sidetable", "drawer", "dresser"),
            "pillow": ("bed",),
            "alarmclock": ("sidetable", "desk", "dresser", "shelf"),
            "pencil": ("desk", "drawer", "sidetable"),
            "pen": ("desk", "drawer", "sidetable", "dresser"),
            "cd": ("desk", "drawer", "shelf", "dresser"),
            "laptop": ("bed", "desk"),
            "keychain": ("dresser", "sidetable", "drawer", "desk"),
            "creditcard": ("desk", "dresser", "drawer", "sidetable"),
        },
        targets=("bed", "desk", "drawer", "dresser", "shelf", "sidetable", "garbagecan"),
    ),
}
# fmt: on
TASK_TYPES = ("pick", "clean", "heat", "cool", "two")
_TASK_WEIGHTS = np.array([0.3, 0.2, 0.15, 0.15, 0.2])
_ADJ = {"clean": "clean", "heat": "hot", "cool": "cool"}

ACTION_FORMAT = """\
You are in a house and must complete the task described at the start.
Each turn, reply with exactly one action, for example:
  go to cabinet 1 | open drawer 2 | close drawer 2 | take mug 1 from countertop 1
  put mug 1 in/on cabinet 1 | clean mug 1 with sinkbasin 1 | heat egg 1 with microwave 1
  cool apple 1 with fridge 1 | examine mug 1 | look | inventory
You can carry one object at a time; closed receptacles must be opened to see inside.
The list of admissible actions is given each turn."""


@dataclasses.dataclass(frozen=True)
class HouseholdGoal:
    task_type: str
    obj: str  # object kind
    target: str  # receptacle kind
    count: int
    text: str
    room: str


@dataclasses.dataclass(frozen=True)
class Scene:
    room: str
    receptacles: tuple[str, ...]  # "cabinet 1", ... in a fixed order
    contents: dict[str, tuple[str, ...]]  # initial placement
    goal: HouseholdGoal


def _kind(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def make_scene(seed: int, split: str, index: int) -> Scene:
    """The scene for goal `index` of `split`; the same arguments give the same scene."""
    rng = np.random.default_rng([seed, _SPLIT_CODE[split], index, 0x40_05E])
    while True:  # rejection-sample a consistent (type, room, object, target)
        task_type = TASK_TYPES[int(rng.choice(len(TASK_TYPES), p=_TASK_WEIGHTS))]
        room_name = str(rng.choice(sorted(ROOMS)))
        room = ROOMS[room_name]
        if task_type in APPLIANCE and APPLIANCE[task_type] not in dict(room.receptacles):
            continue
        pool = {"clean": room.cleanable, "heat": room.heatable, "cool": room.coolable}.get(
            task_type, frozenset(room.objects)
        )
        obj = str(rng.choice(sorted(pool)))
        target = str(rng.choice(room.targets))
        starts = [k for k in room.objects[obj] if k != target and k != APPLIANCE.get(task_type)]
        if starts:
            break
    receptacles = tuple(f"{k} {i}" for k, n in room.receptacles for i in range(1, n + 1))
    contents: dict[str, list[str]] = {r: [] for r in receptacles}
    others = [k for k in sorted(room.objects) if k != obj]
    extra = [others[int(i)] for i in rng.choice(len(others), min(5, len(others)), replace=False)]
    count = 2 if task_type == "two" else 1
    for kind in [obj, *extra]:
        n = int(rng.integers(count, 4)) if kind == obj else int(rng.integers(1, 3))
        allowed = starts if kind == obj else list(room.objects[kind])
        for i in range(1, n + 1):
            rkind = allowed[int(rng.integers(len(allowed)))]
            spots = [r for r in receptacles if _kind(r) == rkind]
            contents[spots[int(rng.integers(len(spots)))]].append(f"{kind} {i}")
    prep = RECEPTACLES[target][0]
    if task_type == "two":
        text = f"put two {obj} {prep} {target}"
    elif task_type == "pick":
        text = f"put a {obj} {prep} {target}"
    else:
        text = f"put a {_ADJ[task_type]} {obj} {prep} {target}"
    goal = HouseholdGoal(task_type, obj, target, count, text, room_name)
    return Scene(room_name, receptacles, {r: tuple(v) for r, v in contents.items()}, goal)


@dataclasses.dataclass
class HouseholdState:
    location: str | None = None
    contents: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    opened: set[str] = dataclasses.field(default_factory=set)
    held: str | None = None
    status: dict[str, set[str]] = dataclasses.field(
        default_factory=lambda: {"clean": set(), "hot": set(), "cool": set()}
    )
    turn: int = 0
    done: bool = False


def _listing(items: list[str]) -> str:
    if not items:
        return "nothing"
    named = [f"a {x}" for x in items]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])}, and {named[-1]}"


_NUM = re.compile(r"([a-z]+)\s*(\d+)")


def _norm(action: str) -> str:
    text = " ".join(action.lower().strip().rstrip(".").split())
    return _NUM.sub(r"\1 \2", text)


@dataclasses.dataclass(frozen=True)
class HouseholdConfig:
    seed: int = 0


class HouseholdEnv:
    """One household episode; deterministic given (config.seed, split, goal index)."""

    def __init__(self, config: HouseholdConfig | None = None, **overrides: Any):
        self.config = config or HouseholdConfig(**overrides)
        self.scene: Scene | None = None
        self.max_turns = DEFAULT_MAX_TURNS
        self.state = HouseholdState()

    def _scene(self) -> Scene:
        if self.scene is None:
            raise RuntimeError("call reset() first")
        return self.scene

    @property
    def goal(self) -> HouseholdGoal:
        return self._scene().goal

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        options = options or {}
        task = task_from_options(options)
        if task is not None:
            split, index, self.max_turns = task.split, task.goal_index, task.max_turns
        else:
            split = options.get("split", "train")
            if "goal_index" in options:
                index = int(options["goal_index"])
            else:
                index = int(np.random.default_rng(seed).integers(SPLIT_SIZES[split]))
            self.max_turns = int(options.get("max_turns", DEFAULT_MAX_TURNS))
        if split not in SPLIT_SIZES or not 0 <= index < SPLIT_SIZES[split]:
            raise ValueError(f"goal_index {index} out of range for split {split!r}")
        self.scene = make_scene(self.config.seed, split, index)
        self.state = HouseholdState(contents={r: list(v) for r, v in self.scene.contents.items()})
        seen = _listing(list(self.scene.receptacles))
        obs = (
            f"You are in the middle of a {self.scene.room}. Looking quickly around you, you "
            f"see {seen}.\n\nYour task is to: {self.goal.text}."
        )
        return obs, self._info(valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.scene is None:
            raise RuntimeError("call reset() before step()")
        if self.state.done:
            raise RuntimeError("the episode is over; call reset()")
        self.state.turn += 1
        obs = self._apply(action) if isinstance(action, str) else None
        valid = obs is not None
        if obs is None:
            obs = "Nothing happens."
        terminated = self.goal_reached()
        if terminated:
            obs += " You have completed the task."
        truncated = not terminated and self.state.turn >= self.max_turns
        self.state.done = terminated or truncated
        return obs, float(terminated), terminated, truncated, self._info(valid=valid)

    def close(self) -> None:
        self.scene = None

    # -- world ----------------------------------------------------------------------------

    def visible(self, recep: str) -> bool:
        return not RECEPTACLES[_kind(recep)][1] or recep in self.state.opened

    def goal_reached(self) -> bool:
        g, st = self.goal, self.state
        need = {"clean": "clean", "heat": "hot", "cool": "cool"}.get(g.task_type)
        n = 0
        for recep, items in st.contents.items():
            if _kind(recep) != g.target:
                continue
            n += sum(
                1 for o in items if _kind(o) == g.obj and (need is None or o in st.status[need])
            )
        return n >= g.count

    def admissible_actions(self) -> list[str]:
        st, scene = self.state, self._scene()
        out = [f"go to {r}" for r in scene.receptacles if r != st.location]
        here = st.location
        if here is not None:
            if RECEPTACLES[_kind(here)][1]:
                out.append(f"close {here}" if here in st.opened else f"open {here}")
            if self.visible(here):
                if st.held is None:
                    out += [f"take {o} from {here}" for o in st.contents[here]]
                else:
                    out.append(f"put {st.held} in/on {here}")
            if st.held is not None:
                for verb, kind in APPLIANCE.items():
                    if _kind(here) == kind:
                        out.append(f"{verb} {st.held} with {here}")
            out.append(f"examine {here}")
        if st.held is not None:
            out.append(f"examine {st.held}")
        return out + ["inventory", "look"]

    def _apply(self, action: str) -> str | None:
        """Applies one action; the observation, or None if nothing happens."""
        a, st, scene = _norm(action), self.state, self._scene()
        receps = scene.receptacles
        here = st.location
        if a == "look":
            where = f"at {here}" if here else f"in the middle of a {scene.room}"
            return f"You are {where}." + (f" {self._describe(here)}" if here else "")
        if a == "inventory":
            return (
                f"You are carrying: a {st.held}." if st.held else "You are not carrying anything."
            )
        if m := re.fullmatch(r"go to (.+)", a):
            dest = m.group(1)
            if dest not in receps or dest == here:
                return None
            st.location = dest
            return f"You arrive at {dest}. {self._describe(dest)}"
        if m := re.fullmatch(r"(open|close) (.+)", a):
            verb, r = m.groups()
            if r != here or not RECEPTACLES[_kind(r)][1] or (r in st.opened) == (verb == "open"):
                return None
            if verb == "open":
                st.opened.add(r)
                return (
                    f"You open the {r}. The {r} is open. In it, you see {_listing(st.contents[r])}."
                )
            st.opened.discard(r)
            return f"You close the {r}."
        if m := re.fullmatch(r"take (.+) from (.+)", a):
            obj, r = m.groups()
            if st.held or r != here or not self.visible(r) or obj not in st.contents[r]:
                return None
            st.contents[r].remove(obj)
            st.held = obj
            return f"You pick up the {obj} from the {r}."
        if m := re.fullmatch(r"put (.+) (?:in/on|in|on) (.+)", a):
            obj, r = m.groups()
            if obj != st.held or r != here or not self.visible(r):
                return None
            st.contents[r].append(obj)
            st.held = None
            return f"You put the {obj} {RECEPTACLES[_kind(r)][0]} the {r}."
        if m := re.fullmatch(r"(clean|heat|cool) (.+) with (.+)", a):
            verb, obj, r = m.groups()
            if obj != st.held or r != here or _kind(r) != APPLIANCE[verb]:
                return None
            room = ROOMS[scene.room]
            allowed = {"clean": room.cleanable, "heat": room.heatable, "cool": room.coolable}
            if _kind(obj) not in allowed[verb]:
                return None
            if verb == "clean":
                st.status["clean"].add(obj)
            else:
                st.status["hot" if verb == "heat" else "cool"].add(obj)
                st.status["cool" if verb == "heat" else "hot"].discard(obj)
            return f"You {verb} the {obj} using the {r}."
        if m := re.fullmatch(r"examine (.+)", a):
            thing = m.group(1)
            if thing == st.held:
                states = [s for s in ("clean", "hot", "cool") if thing in st.status[s]]
                return f"This is a {' '.join(states + [thing]) if states else thing}."
            if thing == here:
                return self._describe(thing)
            return None
        return None

    def _describe(self, r: str) -> str:
        if not self.visible(r):
            return f"The {r} is closed."
        prep = RECEPTACLES[_kind(r)][0].capitalize()
        return f"{prep} it, you see {_listing(self.state.contents[r])}."

    def _info(self, valid: bool) -> dict[str, Any]:
        return {
            "admissible_actions": self.admissible_actions(),
            "turn": self.state.turn,
            "max_turns": self.max_turns,
            "valid": valid,
            "instruction": self.goal.text,
            "task_type": self.goal.task_type,
        }


class HouseholdExpert:
    """A scripted expert, as the ones that produce ALFWorld's demonstrations: it plays
    from the env's state (SFT warm-start data, and proof that the env is solvable).

    It knows where each kind of object is likely to be (the scene generator's placement
    priors) but not where it is: it visits and opens receptacles in that order until it
    sees one, then takes it, cleans / heats / cools it, and puts it at the target.
    """

    def __init__(self, env: HouseholdEnv):
        self.env = env
        self.memory: dict[str, list[str]] = {}

    def act(self, obs: str, info: dict[str, Any]) -> str:
        env, st, goal = self.env, self.env.state, self.env.goal
        scene = env.scene
        assert scene is not None
        if st.turn == 0:
            self.memory = {}
        here = st.location
        if here is not None and env.visible(here):
            self.memory[here] = list(st.contents[here])
        if st.held is not None:
            verb = goal.task_type
            if verb in APPLIANCE:
                adj = {"clean": "clean", "heat": "hot", "cool": "cool"}[verb]
                if st.held not in st.status[adj]:
                    app = next(r for r in scene.receptacles if _kind(r) == APPLIANCE[verb])
                    return f"go to {app}" if here != app else f"{verb} {st.held} with {app}"
            target = next(r for r in scene.receptacles if _kind(r) == goal.target)
            if here != target:
                return f"go to {target}"
            if not env.visible(target):
                return f"open {target}"
            return f"put {st.held} in/on {target}"
        for r, items in self.memory.items():
            if _kind(r) == goal.target:
                continue  # already delivered there
            for o in items:
                if _kind(o) == goal.obj:
                    if here != r:
                        return f"go to {r}"
                    if not env.visible(r):
                        return f"open {r}"
                    return f"take {o} from {r}"
        likely = ROOMS[scene.room].objects[goal.obj]
        order = [r for k in likely for r in scene.receptacles if _kind(r) == k]
        order += [r for r in scene.receptacles if r not in order]
        for r in order:
            if r in self.memory or _kind(r) == goal.target:
                continue
            return f"go to {r}" if here != r else f"open {r}"
        return "look"


register(
    EnvSpec(
        name="household",
        factory=HouseholdEnv,
        default_max_turns=DEFAULT_MAX_TURNS,
        split_sizes=SPLIT_SIZES,
        latency=HOUSEHOLD_LATENCY,
        action_format=ACTION_FORMAT,
        expert=HouseholdExpert,
        config_class=HouseholdConfig,
    )
)
