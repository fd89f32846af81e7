"""`random_params(on_device=True)`: the benchmarks' draw for large presets."""

import jax
import numpy as np
from tidejax.models.model import abstract_params
from tidejax.models.testing import tiny_config
from tidejax.serving.testing import random_params


def test_device_draw_matches_the_model_tree_and_scale():
    config = tiny_config()
    params = random_params(config, seed=3, std=0.05, on_device=True)
    expected = abstract_params(config)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    for (path, leaf), like in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        assert leaf.shape == like.shape and leaf.dtype == like.dtype, name
        values = np.asarray(leaf, np.float32)
        if "scale" in name:
            np.testing.assert_array_equal(values, 1.0)
        elif values.size >= 1000:
            target = 0.02 if "bias" in name else 0.05
            assert abs(values.std() - target) < 0.1 * target, name
    again = random_params(config, seed=3, std=0.05, on_device=True)
    other_seed = random_params(config, seed=4, std=0.05, on_device=True)
    first = np.asarray(params["layers"]["mlp"]["up_kernel"])
    np.testing.assert_array_equal(first, np.asarray(again["layers"]["mlp"]["up_kernel"]))
    assert not np.array_equal(first, np.asarray(other_seed["layers"]["mlp"]["up_kernel"]))
    # Leaves get independent keys: two same-shaped kernels differ.
    assert not np.array_equal(np.asarray(params["layers"]["mlp"]["gate_kernel"]), first)


def test_host_draw_is_numpy_in_leaf_order():
    """Tests that pin greedy tokens depend on these values: numpy's stream, leaf by leaf."""
    config = tiny_config()
    rng = np.random.default_rng(1)
    for path, leaf in jax.tree_util.tree_flatten_with_path(random_params(config, seed=1))[0]:
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            expected = np.ones(leaf.shape, np.float32)
        else:
            expected = rng.normal(0.0, 0.02 if "bias" in name else 0.16, leaf.shape)
        np.testing.assert_array_equal(np.asarray(leaf),
                                      np.asarray(expected, np.float32).astype(leaf.dtype))
