"""Orbax checkpoints: async save, restore onto other submeshes, keep-N, corrupt-latest fallback."""

import functools
import glob
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from tidejax.models.testing import tiny_config

from tidejax.checkpoint import Checkpointer, CheckpointError
from tidejax.rl import RLConfig, make_trainer
from tidejax.rl.testing import FAST_COMPILE, random_params, submesh

CFG = tiny_config()
REF = {"preset": "tiny", "source": "random_params(seed=1)"}


@functools.cache
def trainer(n_devices):
    return make_trainer(CFG, RLConfig(), submesh(n_devices), compiler_options=FAST_COMPILE)


@functools.cache
def make_state(step):
    """A TrainState on 4 devices with distinct values per step (non-zero Adam moments)."""
    state = trainer(4).init_state(step, params=random_params(CFG, seed=step))
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 0.25 * step if x.dtype == np.float32
                                          else x, s.opt_state))
    return state.replace(opt_state=bump(state), step=state.step + step,
                         policy_version=state.policy_version + 2 * step)


def assert_same(restored, saved):
    chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(saved))


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """Steps 1..3 saved asynchronously from 4 devices with max_to_keep=2."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, make_state(s), ref_model=REF, data_cursor={"epoch": 0, "index": 10 * s},
                      controller={"mode": "decoupled", "ranks": [4, 2]})
        ckpt.wait()
    return directory


@pytest.fixture
def saved(saved_dir, tmp_path):
    """A private copy of the saved run (tests may damage it)."""
    directory = str(tmp_path / "run")
    shutil.copytree(saved_dir, directory)
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        yield ckpt, {s: make_state(s) for s in (1, 2, 3)}


@pytest.mark.parametrize("n_devices", [2, 6])
def test_restore_onto_another_submesh(saved, n_devices):
    ckpt, states = saved
    target = trainer(n_devices).abstract_state()
    got = ckpt.restore(target)
    assert got.step == 3
    assert_same(got.state, states[3])
    want = trainer(n_devices).state_shardings
    jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail(str(s)),
                 got.state, want)
    assert got.ref_model == REF
    assert got.data_cursor == {"epoch": 0, "index": 30}
    assert got.controller == {"mode": "decoupled", "ranks": [4, 2]}


def test_keeps_the_last_n(saved):
    ckpt, _ = saved
    assert ckpt.all_steps() == [2, 3]
    assert sorted(os.listdir(ckpt.directory)) == ["2", "3"]


def _flip_bytes(step_dir, largest_only):
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True)
             if os.path.isfile(f) and f"{os.sep}d{os.sep}" in f]
    assert files, "no array data files found to damage"
    for f in [max(files, key=os.path.getsize)] if largest_only else files:
        with open(f, "r+b") as fh:
            data = bytearray(fh.read())
            mid = len(data) // 2
            fh.seek(mid)
            fh.write(bytes(b ^ 0xFF for b in data[mid:mid + 16]))


# damage -> what the warning names. Flipping bytes inside one array chunk mostly reads back
# without error (silent corruption), and only the fingerprint in the metadata catches it;
# when the flipped bytes land on the compressed chunk's own structure the read fails
# instead (seen in CI). Either way the step is skipped.
DAMAGE = {"flip_one_chunk": "fingerprint|Error", "flip_every_file": "Error",
          "drop_state_item": "state", "truncate_meta": "JSON|Expecting|Unterminated"}


# Orbax leaves a callback on its closed event loop after a failed read; that is noise.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_falls_back_to_the_one_before(saved, damage):
    ckpt, states = saved
    step_dir = os.path.join(ckpt.directory, "3")
    if damage.startswith("flip"):
        _flip_bytes(step_dir, largest_only=damage == "flip_one_chunk")
    elif damage == "drop_state_item":  # incomplete: the arrays never landed
        shutil.rmtree(os.path.join(step_dir, "state"))
    else:
        with open(os.path.join(step_dir, "meta", "metadata"), "r+") as fh:
            fh.truncate(20)
    target = trainer(2).abstract_state()
    with pytest.warns(UserWarning, match=f"skipping checkpoint step 3.*({DAMAGE[damage]})"):
        got = ckpt.restore(target)
    assert got.step == 2
    assert_same(got.state, states[2])
    assert got.data_cursor == {"epoch": 0, "index": 20}
    with pytest.raises(CheckpointError):
        ckpt.restore(target, step=3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_restore_picks_each_steps_mesh_from_its_metadata(tmp_path):
    """A resumed run's actor mesh is recorded with the checkpoint: the abstract state may
    be a function of the step's controller metadata, asked again for an older step when
    the newest is unreadable."""
    with Checkpointer(str(tmp_path / "run"), max_to_keep=2) as ckpt:
        for step, actor in ((1, 2), (2, 6)):
            ckpt.save(step, make_state(step), ref_model=REF, controller={"actor": actor})
        ckpt.wait()
        asked = []

        def abstract_for(controller):
            asked.append(controller["actor"])
            return trainer(controller["actor"]).abstract_state()

        def on_devices(state):
            return {d.id for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set}

        got = ckpt.restore(abstract_for)
        assert (got.step, asked) == (2, [6])
        assert on_devices(got.state) == {d.id for d in submesh(6).devices.flat}
        assert_same(got.state, make_state(2))
        _flip_bytes(os.path.join(ckpt.directory, "2"), largest_only=False)
        with pytest.warns(UserWarning, match="skipping checkpoint step 2"):
            got = ckpt.restore(abstract_for)
        assert (got.step, asked) == (1, [6, 6, 2])
        assert on_devices(got.state) == {d.id for d in submesh(2).devices.flat}
        assert_same(got.state, make_state(1))


def test_no_checkpoint_raises(tmp_path):
    with Checkpointer(str(tmp_path / "empty")) as ckpt, \
            pytest.raises(CheckpointError, match="no checkpoint"):
        ckpt.restore(trainer(2).abstract_state())


def test_relative_directory_saves_and_restores(tmp_path, monkeypatch):
    """Orbax rejects relative paths; the job's default run directory is relative."""
    monkeypatch.chdir(tmp_path)
    state = make_state(1)
    with Checkpointer(os.path.join("runs", "rel", "checkpoints")) as ckpt:
        ckpt.save(1, state, ref_model=REF)
        ckpt.wait()
        restored = ckpt.restore(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    assert (tmp_path / "runs" / "rel" / "checkpoints" / "1").is_dir()
    assert_same(restored.state, state)


def test_params_fingerprint_is_the_stacked_fingerprint_of_per_layer_weights():
    """An engine's per-layer weights fingerprint as the trainer's stacked ones (the
    multi-host sync check compares the two), and a one-element change shows."""
    from tidejax.checkpoint import fingerprint, params_fingerprint
    from tidejax.models.model import unstack_layers
    from tidejax.models.testing import tiny_params

    params = tiny_params()
    per_layer = unstack_layers(params)
    assert params_fingerprint(per_layer) == fingerprint(params) == params_fingerprint(params)
    layers = list(per_layer["layers"])
    changed = dict(layers[1], mlp=dict(layers[1]["mlp"]))
    changed["mlp"]["up_kernel"] = changed["mlp"]["up_kernel"].at[0, 0].add(1.0)
    layers[1] = changed
    assert params_fingerprint({**per_layer, "layers": tuple(layers)}) != fingerprint(params)
