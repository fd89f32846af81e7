"""A user's env, defined only in this module (not in tidejax), reached by its
"module:Class" name: through the job's CLI with an `[env]` table, behind the env server,
and through the pool, whose replays of a non-deterministic env are caught.

The job and the server run as child processes with this folder on PYTHONPATH, as a user
runs them with their own package installed; they import this module as `test_user_env`.
"""

import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid

import pytest

from tidejax.config import run_config_from_dict
from tidejax.envs import EnvPool, PoolConfig, Task, get_spec, make_env, make_tasks
from tidejax.envs.protocol import MAX_ACTION_CHARS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODULE = "test_user_env"  # the name the child processes import this file under
ECHO = f"{MODULE}:EchoEnv"
WORDS = ("apple", "river", "stone", "cloud", "maple", "amber", "orbit", "lemon")


@dataclasses.dataclass(frozen=True)
class EchoSettings:
    greeting: str = "Repeat the word you are shown."
    win_reward: float = 1.0
    trace_path: str = ""  # when set, each reset appends "task_id seed word greeting" to it

    def __post_init__(self):
        if not self.win_reward > 0:
            raise ValueError(f"win_reward must be > 0, got {self.win_reward}")


class EchoEnv:
    """Shows a word; writing it back as say[word] wins. The word depends on the seed."""

    split_sizes = {"train": 40, "eval": 10, "test": 10}
    max_turns = 3
    action_format = "Answer with say[<word>], the word you were shown."
    config_class = EchoSettings

    def __init__(self, settings: EchoSettings):
        self.settings = settings
        self.word, self.turn, self.max_turns = "", 0, self.max_turns

    def reset(self, seed=None, options=None):
        task = options["task"]
        if task.data:  # a dataset row ([task_data]) names the word
            self.word = task.data["metadata"]["word"]
        else:
            self.word = WORDS[(task.goal_index + (seed or 0)) % len(WORDS)]
        self.turn, self.max_turns = 0, task.max_turns
        if self.settings.trace_path:
            with open(self.settings.trace_path, "a") as f:
                f.write(f"{task.task_id} {seed} {self.word} {self.settings.greeting}\n")
        return f"{self.settings.greeting} The word is {self.word}.", {"seed": seed}

    def step(self, action):
        self.turn += 1
        if action.strip() == f"say[{self.word}]":
            return "Correct.", self.settings.win_reward, True, False, {"won": True}
        return "Try again.", 0.0, False, self.turn >= self.max_turns, {"won": False}

    def close(self):
        pass


def child_env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the job sets its own device count
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    return env


def echo_task(goal_index=3, seed=5, task_id="t0"):
    return Task(task_id, "g0", "train", f"{__name__}:EchoEnv", goal_index, 3, seed=seed)


# ------------------------------------------------------------------ naming and settings
def test_class_name_resolves_and_its_settings_are_checked_at_load():
    name = f"{__name__}:EchoEnv"
    spec = get_spec(name)
    assert spec.default_max_turns == 3 and spec.split_sizes["train"] == 40
    assert spec.expert is None and spec.config_class is EchoSettings
    cfg = run_config_from_dict({"env_type": name, "env": {"greeting": "Hello."}})
    assert cfg.env_kwargs() == {"greeting": "Hello."}
    assert make_env(name, **cfg.env_kwargs()).settings.greeting == "Hello."
    with pytest.raises(ValueError, match=r"env\.win_reward"):
        run_config_from_dict({"env_type": name, "env": {"win_reward": 0}})
    with pytest.raises(ValueError, match=r"unknown env setting env\.colour"):
        run_config_from_dict({"env_type": name, "env": {"colour": "red"}})
    with pytest.raises(ValueError, match=r"env\.greeting must be a str"):
        run_config_from_dict({"env_type": name, "env": {"greeting": 3}})
    with pytest.raises(ValueError, match=r"RunConfig\.env_type.*no_such_module"):
        run_config_from_dict({"env_type": "no_such_module:Env"})
    with pytest.raises(ValueError, match=r"RunConfig\.env_type.*unknown env type 'webshopp'"):
        run_config_from_dict({"env_type": "webshopp"})


def test_pool_passes_the_task_seed_on_every_reset_and_limits_actions_alike():
    async def run():
        async with EnvPool(PoolConfig(max_retries=0)) as pool:
            first = await pool.reset(echo_task(seed=5))
            assert first.info["seed"] == 5 and "apple" in first.obs  # WORDS[(3 + 5) % 8]
            won = await pool.step("t0", "say[apple]")
            assert won.terminated and won.reward == 1.0
            await pool.reset(echo_task(seed=6))
            long = await pool.step("t0", "x" * (MAX_ACTION_CHARS + 1))
            assert long.error == "action_too_long" and long.truncated
            assert pool.stats.action_too_long == 1 and pool.active_tasks == 0

    asyncio.run(run())
    tasks = make_tasks(f"{__name__}:EchoEnv", "train", 3, 2, seed=0)
    assert [t.seed for t in tasks[::2]] == [t.seed for t in tasks[1::2]]  # one per group
    assert len({t.seed for t in tasks}) == 3


def test_max_open_episodes_caps_open_episodes_not_just_calls():
    async def run():
        async with EnvPool(PoolConfig(capacity=16, max_open_episodes=2)) as pool:
            async def episode(i):
                first = await pool.reset(echo_task(goal_index=i, seed=0, task_id=f"m{i}"))
                await asyncio.sleep(0.01)  # the episode stays open between calls
                word = first.obs.rsplit(" ", 1)[-1].rstrip(".")
                return await pool.step(f"m{i}", f"say[{word}]")

            results = await asyncio.gather(*(episode(i) for i in range(6)))
            return results, pool.stats

    results, stats = asyncio.run(run())
    assert all(r.ok and r.reward == 1.0 for r in results)  # all six ran, two at a time
    assert stats.peak_open_episodes == 2 and stats.resets == 6


# ------------------------------------------------------------------ the job, end to end
@pytest.fixture
def relative_run_dir():
    rel = os.path.join("runs", "test-user-env", uuid.uuid4().hex[:8])
    yield rel
    shutil.rmtree(os.path.join(ROOT, rel), ignore_errors=True)


def test_job_cli_trains_on_a_user_env_named_in_the_config(tmp_path, relative_run_dir):
    trace = tmp_path / "resets.txt"
    rows = tmp_path / "words.jsonl"  # the training goals come from a dataset
    row_words = ("quartz", "willow", "harbor")
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Echo."}],
                                        "metadata": {"word": w}}) + "\n" for w in row_words))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'env_type = "{ECHO}"\n'
                   f'tokenizer_vocab = 300\n'
                   f'[rollout]\nenv_max_open_episodes = 3\n'
                   f'[task_data]\ntrain = "{rows}"\n'
                   f'[env]\ngreeting = "Echo, please."\ntrace_path = "{trace}"\n')
    cmd = [sys.executable, "-m", "tidejax.experiments.webshop", "--config", str(cfg), "--quick",
           "--devices", "4", "--out", relative_run_dir, "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "system=tide steps=2" in proc.stdout
    out = os.path.join(ROOT, relative_run_dir)
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["steps"] == 2
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["env_type"] == ECHO
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["env/replay_diverged"] == 0 and r["env/resets"] > 0 for r in steps)
    assert all(r["env/peak_open_episodes"] <= 3 for r in steps)  # the [rollout] cap
    assert [r for r in records if r["kind"] == "eval_episode"]
    assert os.path.exists(os.path.join(out, "tokenizer.json"))  # trained on the env's text
    assert not os.path.exists(os.path.join(out, "sft_params.npz"))  # no expert: no SFT
    assert "declares no expert: SFT warm start skipped" in proc.stderr
    resets = [line.split(" ", 3) for line in trace.read_text().splitlines()]
    assert resets and all(greeting == "Echo, please." for *_, greeting in resets)
    assert all(seed != "None" for _, seed, _, _ in resets)  # every reset got its seed
    assert {word for _, _, word, _ in resets} <= set(row_words)  # goals from the rows


def test_job_cli_refuses_an_unknown_env_at_start(tmp_path):
    cmd = [sys.executable, "-m", "tidejax.experiments.webshop", "--env-type",
           f"{MODULE}:NoSuchEnv", "--out", str(tmp_path / "x")]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "RunConfig.env_type" in proc.stderr and "NoSuchEnv" in proc.stderr
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ behind the env server
def start_server(*args, timeout_s=60):
    cmd = [sys.executable, "-m", "tidejax.envs.server", "--host", "127.0.0.1", "--port", "0",
           *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)  # bounded: a server that never prints fails the test
    if not lines or "listening on" not in lines[0]:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"server did not start: {lines} {proc.stderr.read()[-2000:]}")
    return proc, lines[0].rsplit(" ", 1)[-1].strip()


def test_env_server_hosts_a_user_env_by_class_name():
    kwargs = json.dumps({ECHO: {"greeting": "Served."}})
    proc, address = start_server("--env", ECHO, "--env-kwargs", kwargs)
    try:
        async def run():
            task = Task("r0", "g0", "train", ECHO, 1, 3, seed=2)
            async with EnvPool(PoolConfig(max_retries=0), addresses=[address]) as pool:
                first = await pool.reset(task)
                assert first.ok, first.info
                assert first.obs == "Served. The word is cloud." and first.info["seed"] == 2
                assert (await pool.step("r0", "say[stone]")).reward == 0.0
                won = await pool.step("r0", "say[cloud]")
                assert won.terminated and won.reward == 1.0 and won.info["won"]
                # The same action limit as a local pool, checked before the request.
                await pool.reset(task)
                long = await pool.step("r0", "x" * (MAX_ACTION_CHARS + 1))
                assert long.error == "action_too_long"
                # A class the server was not started with is refused, not imported.
                other = Task("r1", "g1", "train", f"{MODULE}:DriftingEnv", 0, 3)
                refused = await pool.reset(other)
                assert refused.error == "exception" and "--env" in refused.info["detail"]

        asyncio.run(run())
    finally:
        proc.kill()  # by its own pid
        proc.wait(10)


def test_env_server_refuses_an_unknown_env_at_start():
    cmd = [sys.executable, "-m", "tidejax.envs.server", "--port", "0", "--env",
           f"{MODULE}:NoSuchEnv"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "NoSuchEnv" in proc.stderr


# ------------------------------------------------------------------ replay verification
FAIL_FIRST_STEP: set[str] = set()  # task ids whose env raises once, on its first step
_instances = itertools.count()


class SteadyEnv:
    """Deterministic given task and seed; raises once for tasks in FAIL_FIRST_STEP."""

    split_sizes = {"train": 8, "eval": 4, "test": 4}
    max_turns = 3

    def __init__(self):
        self.instance = next(_instances)
        self.task, self.turn = None, 0

    def first_observation(self, seed):
        return f"Room {seed % 97}."

    def reset(self, seed=None, options=None):
        self.task, self.turn = options["task"], 0
        return self.first_observation(seed), {}

    def step(self, action):
        self.turn += 1
        if self.turn == 2 and self.task.task_id in FAIL_FIRST_STEP:
            FAIL_FIRST_STEP.discard(self.task.task_id)
            raise RuntimeError("the env's backend dropped the connection")
        return f"Turn {self.turn}.", 0.0, False, self.turn >= self.task.max_turns, {}

    def close(self):
        pass


class DriftingEnv(SteadyEnv):
    """Like SteadyEnv, but a fresh instance shows a different first room: replays diverge."""

    def first_observation(self, seed):
        return f"Room {seed % 97}, instance {self.instance}."


@pytest.mark.parametrize("cls", ["SteadyEnv", "DriftingEnv"])
def test_pool_verifies_a_replay_against_what_was_seen(cls):
    name = f"{__name__}:{cls}"

    async def run():
        task = Task("p0", "g0", "train", name, 0, 3, seed=4)
        FAIL_FIRST_STEP.add("p0")
        async with EnvPool(PoolConfig(max_retries=1)) as pool:
            first = await pool.reset(task)
            await pool.step("p0", "look")
            second = await pool.step("p0", "look")  # raises; the pool rebuilds and replays
            return first, second, pool.stats

    first, second, stats = asyncio.run(run())
    if cls == "SteadyEnv":  # the replay matched: the step went through
        assert second.ok and second.obs == "Turn 2." and second.faults == ("exception",)
        assert stats.replay_diverged == 0 and stats.recovered == 1
    else:  # the rebuilt env showed another room: never carried on silently
        assert second.error == "replay_diverged" and second.truncated
        assert second.faults == ("exception", "replay_diverged")
        assert stats.replay_diverged == 1 and stats.failed_tasks == 1


def test_a_diverging_replay_restarts_the_task_nothing_lost_or_duplicated():
    from tests.runtime.mock_rollout import run_on_one_mock_rank

    name = f"{__name__}:DriftingEnv"
    tasks = make_tasks(name, "train", 2, 2, seed=0, max_turns=3)
    FAIL_FIRST_STEP.add(tasks[1].task_id)
    manager, buffer, stats, tok = run_on_one_mock_rank(
        name, tasks, 2, env_retries=1, max_task_attempts=2, retry_backoff_s=0.001)
    assert stats.replay_diverged == 1  # detected
    assert manager.counters["task_retries"] == 1  # restarted from scratch, counted
    assert manager.dropped_tasks == [] and not buffer.dropped
    groups = buffer.take(10, trainer_version=0)
    seen = sorted(tid for g in groups for tid in g.payload.task_ids)
    assert seen == sorted(t.task_id for t in tasks)  # nothing lost, nothing duplicated
    restarted = [traj for g in groups for tid, traj in zip(g.payload.task_ids,
                                                            g.payload.trajectories)
                 if tid == tasks[1].task_id]
    assert len(restarted) == 1
    text = tok.decode(list(restarted[0].tokens))
    assert text.count("Room ") == 1  # one episode: the restarted one, not a spliced replay


# ------------------------------------------------------------------ demonstrations file
def test_sft_demonstrations_from_a_jsonl_file_of_chat_messages(tmp_path):
    from tidejax.models.testing import tiny_tokenizer
    from tidejax.runtime.job import demo_episode_tokens, demonstrations

    good = tmp_path / "demos.jsonl"
    rows = [{"messages": [{"role": "system", "content": "ignored"},
                          {"role": "user", "content": "The word is apple."},
                          {"role": "assistant", "content": "say[river]"},
                          {"role": "user", "content": "Try again."},
                          {"role": "assistant", "content": "say[apple]"}]},
            {"messages": [{"role": "user", "content": "The word is stone."},
                          {"role": "assistant", "content": "say[stone]"},
                          {"role": "user", "content": "Correct."}]}]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = run_config_from_dict({"env_type": ECHO, "sft": {"demonstrations": str(good)}})
    demos = demonstrations(cfg)
    assert [d.turns for d in demos] == [
        (("The word is apple.", "say[river]"), ("Try again.", "say[apple]")),
        (("The word is stone.", "say[stone]"),)]
    tok = tiny_tokenizer()
    episodes = demo_episode_tokens(tok, ECHO, demos)
    trained = [t for t, m in zip(episodes[1].tokens, episodes[1].loss_mask) if m]
    assert tok.decode(trained) == "say[stone]"  # only the action is learned
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[1]) + "\n" + json.dumps(
        {"messages": [{"role": "assistant", "content": "say[x]"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: messages\[0\] is an assistant"):
        demonstrations(run_config_from_dict({"env_type": ECHO,
                                             "sft": {"demonstrations": str(bad)}}))
    with pytest.raises(ValueError, match=r"SftConfig\.demonstrations: no such file"):
        run_config_from_dict({"sft": {"demonstrations": str(tmp_path / "none.jsonl")}})


# ------------------------------------------------------------------ installed plugins
def test_an_installed_plugin_is_found_by_its_entry_point_name(tmp_path, monkeypatch):
    """A distribution declaring `[tidejax.envs] echo-plugin = test_user_env:EchoEnv`
    (here a bare .dist-info folder on sys.path, which is what pip installs)."""
    dist = tmp_path / "echo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[tidejax.envs]\necho-plugin = {ECHO}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(HERE)
    from tidejax.envs import plugin_names

    assert "echo-plugin" in plugin_names()
    spec = get_spec("echo-plugin")
    assert spec.name == "echo-plugin" and spec.split_sizes["train"] == 40
    cfg = run_config_from_dict({"env_type": "echo-plugin", "env": {"greeting": "Hi."}})
    task = make_tasks(cfg.env_type, "train", 1, 2, seed=0)[0]
    env = make_env(cfg.env_type, **cfg.env_kwargs())
    obs, _ = env.reset(seed=task.reset_seed, options={"task": task})
    assert obs.startswith("Hi. The word is ")


# ------------------------------------------------------------------ env reuse
class CountedEnv(SteadyEnv):
    """SteadyEnv that counts instances built and closed (class-level, for the test)."""

    built = 0
    closed = 0

    def __init__(self):
        super().__init__()
        CountedEnv.built += 1

    def close(self):
        CountedEnv.closed += 1


@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_envs_keeps_finished_envs_in_a_free_list(reuse):
    name = f"{__name__}:CountedEnv"
    CountedEnv.built = CountedEnv.closed = 0
    FAIL_FIRST_STEP.add("u3")

    async def run():
        async with EnvPool(PoolConfig(max_retries=1, reuse_envs=reuse, workers=1)) as pool:
            for i in range(5):  # one after another: one env serves all when reused
                result = await pool.reset(Task(f"u{i}", f"g{i}", "train", name, 0, 2))
                while not result.done:
                    result = await pool.step(f"u{i}", "look")
                assert result.ok and result.obs == "Turn 2."
            return pool.stats

    stats = asyncio.run(run())
    assert CountedEnv.closed == CountedEnv.built  # none leaked, the free list included
    if reuse:  # u3's env raised: it is closed, never reused; its replay took a new one
        assert CountedEnv.built == 2 and stats.reused_envs == 4 and stats.recovered == 1
    else:  # a fresh env per reset and per replay
        assert CountedEnv.built == 6 and stats.reused_envs == 0


def test_server_resolves_class_names_per_request_only_when_allowed():
    from tidejax.envs import EnvServer, ServerConfig

    task = Task("a0", "g0", "train", f"{__name__}:EchoEnv", 0, 3, seed=1)

    async def reset_on(server):
        async with EnvPool(PoolConfig(max_retries=0), addresses=[server.address]) as pool:
            return await pool.reset(task)

    with EnvServer(ServerConfig(port=0)) as server:  # started without --env
        refused = asyncio.run(reset_on(server))
    with EnvServer(ServerConfig(port=0, allow_import=True)) as server:
        allowed = asyncio.run(reset_on(server))
    assert refused.error == "exception" and "--allow-import" in refused.info["detail"]
    assert allowed.ok and allowed.obs.endswith("The word is river.")
