"""Parity with HF transformers' Qwen2 on random tiny models, and loader error paths."""

import json
import os

import jax
import numpy as np
import pytest

from tidejax import models
from tidejax.models.safetensors_io import SafetensorsFile, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_model(tmp_path, tied: bool, heads=4, kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    # Random biases, so the bias loading path is really checked (HF inits them to zero).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    path = tmp_path / f"hf_{'tied' if tied else 'untied'}_{heads}_{kv_heads}"
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.mark.parametrize("tied,heads,kv_heads", [(True, 4, 2), (False, 4, 1), (False, 4, 4)])
def test_logits_match_transformers(tmp_path, tied, heads, kv_heads):
    model, path = _hf_model(tmp_path, tied, heads, kv_heads)
    config, params = models.load_hf(path, dtype="float32")
    assert config.tie_word_embeddings == tied and config.num_kv_heads == kv_heads
    # without a mesh nothing lands on a device: the caller places the weights
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, 11))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(models.forward(config, params, tokens))
    assert got.shape == (2, 11, 97)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_sharded_index_and_mesh_placement(tmp_path):
    model, path = _hf_model(tmp_path, tied=False)
    # Re-save as two shards with an index, the layout big checkpoints use.
    single = SafetensorsFile(path / "model.safetensors")
    names = single.names()
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: np.array(single.get(n)) for n in part}, path / fname)
        weight_map.update({n: fname for n in part})
    os.remove(path / "model.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    mesh = models.make_mesh(jax.devices()[:4], fsdp=2, tensor=2)
    config, params = models.load_hf(path, mesh=mesh, rules=models.TRAIN_RULES)
    assert params["layers"]["mlp"]["up_kernel"].sharding.mesh.shape == mesh.shape
    tokens = np.arange(14).reshape(2, 7)
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(models.forward(config, params, tokens)), want,
                               atol=1e-4)


def test_missing_tensor_is_named(tmp_path):
    _, path = _hf_model(tmp_path, tied=True)
    st = SafetensorsFile(path / "model.safetensors")
    kept = {n: np.array(st.get(n)) for n in st.names() if "layers.1.mlp.up_proj" not in n}
    save_file(kept, path / "model.safetensors")
    with pytest.raises(models.CheckpointError, match="layers.1.mlp.up_proj.weight"):
        models.load_hf(path)


def test_wrong_shape_is_named(tmp_path):
    _, path = _hf_model(tmp_path, tied=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 50
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(models.CheckpointError, match="gate_proj.weight has shape"):
        models.load_hf(path)


def test_unsupported_model_type(tmp_path):
    _, path = _hf_model(tmp_path, tied=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        models.load_hf(path)
