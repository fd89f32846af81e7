"""A weight sync hands every rollout rank the trainer's copy at once: the ranks' threads
must not run JAX's resharding `device_put` on those arrays concurrently (JAX 0.10 fails
intermittently with a safe_zip length mismatch when they do)."""

import threading
import time

import jax
from tidejax.models.sharding import TRAIN_RULES, make_mesh, param_shardings
from tidejax.models.testing import tiny_config
from tidejax.serving.testing import random_params, tiny_engine


def test_ranks_loading_one_source_never_place_it_concurrently(monkeypatch):
    devices = jax.devices()
    engines = [tiny_engine(devices=[d]) for d in devices[:4]]
    config = tiny_config()
    trainer_copy = jax.device_put(random_params(config, seed=1),
                                  param_shardings(config, make_mesh(devices[4:]), TRAIN_RULES))
    inside, most = [0], [0]
    count = threading.Lock()
    real_put = jax.device_put

    def watched_put(*args, **kwargs):
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # widen the window two unserialised threads would overlap in
        try:
            return real_put(*args, **kwargs)
        finally:
            with count:
                inside[0] -= 1

    monkeypatch.setattr(jax, "device_put", watched_put)
    start = threading.Barrier(len(engines))
    loaded, errors = {}, []

    def load(engine):
        start.wait()
        try:
            loaded[engine] = engine.load_params(trainer_copy)
        except Exception as e:  # noqa: BLE001 - reported below with the rank
            errors.append(repr(e))

    threads = [threading.Thread(target=load, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(loaded) == len(engines)
    assert most[0] == 1, f"{most[0]} placements ran at once"
    monkeypatch.undo()
    want = jax.device_get(trainer_copy["embedder"])
    for engine, params in loaded.items():
        got = params["embedder"]
        assert all(a.sharding.device_set == set(engine.mesh.devices.flat)
                   for a in jax.tree.leaves(got))
        assert jax.tree.all(jax.tree.map(lambda a, b: bool((jax.device_get(a) == b).all()),
                                         got, want))
