"""``kt_kernel.utils.loader``: the original's loader names over real files (converted AMX
safetensors written by our converter, GGUF written by gguf-py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from kt_kernel import convert
from kt_kernel.utils import GGUFLoader, SafeTensorLoader
from kt_kernel.utils.loader import GGML_QUANT_SIZES, translate_name_to_gguf
from safetensors import safe_open
from safetensors.torch import save_file


def _checkpoint(folder, e=4, h=128, i=128, layer=1):
    g = torch.Generator().manual_seed(0)
    t = {}
    for x in range(e):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
            t[f"model.layers.{layer}.mlp.experts.{x}.{name}.weight"] = w
    folder.mkdir()
    save_file(t, str(folder / "model.safetensors"))
    config = {"hidden_size": h, "moe_intermediate_size": i, "num_experts": e}
    (folder / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 2}))


def test_safetensor_loader_reads_converted_experts(tmp_path):
    _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "int8"
    args = ["-i", str(tmp_path / "ckpt"), "-o", str(out), "--quant-method", "int8", "-q"]
    assert convert.main([*args, "--threadpool-count", "2"]) == 0
    loader = SafeTensorLoader(str(out))
    experts = loader.load_experts("blk.1")
    assert set(experts) == {"up", "gate", "down", "up_scale", "gate_scale", "down_scale"}
    assert len(experts["up"]) == 2 and all(len(part) == 4 for part in experts["up"])
    # The arrays are the file's bytes.
    key = "blk.1.ffn_down_exps.3.numa.1.weight"
    file = loader.tensor_file_map[key]
    with safe_open(file, framework="pt") as f:
        assert np.array_equal(experts["down"][1][3], f.get_tensor(key).numpy())
    assert loader.has_tensor(key) and not loader.has_tensor("blk.1.nothing")
    with pytest.raises(ValueError, match="No experts found"):
        loader.load_experts("blk.7")
    with pytest.raises(KeyError):
        loader.load_tensor("blk.1.nothing")
    with pytest.raises(FileNotFoundError):
        SafeTensorLoader(str(tmp_path / "missing"))


def test_gguf_loader_reads_tensors_types_and_the_model_shape(tmp_path):
    e, i, h = 4, 64, 256
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_expert_count(e)
    writer.add_expert_used_count(2)
    writer.add_embedding_length(h)
    rng = np.random.default_rng(0)
    q8 = GGMLQuantizationType.Q8_0
    block, nbytes = GGML_QUANT_SIZES[q8]
    raw = rng.integers(0, 255, size=(e, i, h // block * nbytes), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loader = GGUFLoader(str(path))
    assert loader.has_tensor("blk.0.ffn_gate_exps.weight")
    assert loader.get_ggml_type("blk.0.ffn_gate_exps.weight") == int(q8)
    data, ty = loader.get_undequanted_tensor_and_ggml_type("blk.0.ffn_gate_exps.weight")
    assert ty == int(q8) and np.array_equal(data.numpy(), raw.reshape(-1))
    config = loader.get_model_config(0)
    assert config == {
        "num_experts": e,
        "num_experts_per_tok": 2,
        "hidden_size": h,
        "moe_intermediate_size": i,
    }
    assert GGUFLoader(str(tmp_path)).has_tensor("blk.0.ffn_gate_exps.weight")  # a folder
    with pytest.raises(ValueError, match="gguf file or a directory"):
        GGUFLoader(str(_text_file(tmp_path)))
    with pytest.raises(FileNotFoundError):
        GGUFLoader(str(tmp_path / "none.gguf"))


def test_names_translate_to_gguf():
    t = translate_name_to_gguf
    assert t("model.layers.3.mlp.experts") == "blk.3"
    assert t("model.layers.0.self_attn.q_proj.weight") == "blk.0.attn_q.weight"
    assert t("model.layers.2.mlp.gate.weight") == "blk.2.ffn_gate_inp.weight"
    assert t("model.layers.1.block_sparse_moe.experts") == "blk.1"
    assert t("model.embed_tokens.weight") == "token_embd.weight"


def _text_file(folder):
    p = folder / "notes.txt"
    p.write_text("not gguf")
    return p
