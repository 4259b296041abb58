"""load_weights from Hugging Face safetensors checkpoints written by the safetensors package."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_wrapper, random_experts, random_routing, reference_moe, rel_l2
from safetensors.torch import save_file

E, K, H, I = 8, 2, 64, 96  # noqa: E741 (the model's own letters)


def write_checkpoint(path, layers, naming="qwen", dtype=torch.bfloat16, shards=1, prefix="model"):
    """Write `layers` [(gate, up, down)] in one of the naming schemes; returns nothing."""
    tensors = {}
    for layer, (g, u, d) in enumerate(layers):
        base = f"{prefix}.layers.{layer}"
        if naming == "packed":
            tensors[f"{base}.mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1).to(dtype)
            tensors[f"{base}.mlp.experts.down_proj"] = d.to(dtype).contiguous()
            continue
        for e in range(g.shape[0]):
            if naming == "mixtral":
                names = [
                    f"{base}.block_sparse_moe.experts.{e}.{n}.weight" for n in ("w1", "w3", "w2")
                ]
            else:
                names = [f"{base}.mlp.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")]
            for name, t in zip(names, (g[e], u[e], d[e]), strict=True):
                tensors[name] = t.to(dtype).contiguous()
        tensors[f"{base}.self_attn.q_proj.weight"] = torch.zeros(4, 4, dtype=dtype)
    keys = sorted(tensors)
    per = -(-len(keys) // shards)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s * per : (s + 1) * per]}
        save_file(part, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"num_experts": E}))


def check_layer(path, layer_idx, weights, map_=None):
    w = make_wrapper(layer_idx=layer_idx, e=E, k=K, h=H, i=I, weight_path=str(path))
    w.load_weights(map_)
    x = torch.randn(6, H)
    ids, wt = random_routing(6, E, K, seed=layer_idx)
    g, u, d = (t.to(torch.bfloat16) for t in weights)
    if map_ is not None:
        g, u, d = g[map_], u[map_], d[map_]
    assert rel_l2(w.forward(x, ids, wt, None), reference_moe(x, ids, wt, g, u, d)) < 5e-3


@pytest.mark.parametrize("naming", ["qwen", "mixtral", "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_checkpoint_namings_and_dtypes(tmp_path, naming, dtype):
    layers = [random_experts(E, H, I, dtype=torch.float32, seed=s) for s in range(2)]
    write_checkpoint(tmp_path, layers, naming=naming, dtype=dtype, shards=3)
    for layer in range(2):
        check_layer(tmp_path, layer, layers[layer])


@pytest.mark.parametrize("naming", ["qwen", "packed"])
def test_a_layer_may_read_fewer_experts_than_the_file_holds(tmp_path, naming):
    # 8 experts on file, a 4-expert layer mapped onto logical experts 7, 2, 5, 0.
    layers = [random_experts(E, H, I, dtype=torch.float32, seed=9)]
    write_checkpoint(tmp_path, layers, naming=naming)
    m = torch.tensor([7, 2, 5, 0])
    w = make_wrapper(e=4, k=K, h=H, i=I, weight_path=str(tmp_path))
    w.load_weights(m)
    x = torch.randn(5, H)
    ids, wt = random_routing(5, 4, K, seed=3)
    g, u, d = (t.to(torch.bfloat16)[m] for t in layers[0])
    assert rel_l2(w.forward(x, ids, wt, None), reference_moe(x, ids, wt, g, u, d)) < 5e-3


def test_physical_to_logical_map_on_file_path(tmp_path):
    layers = [random_experts(E, H, I, dtype=torch.float32, seed=7)]
    write_checkpoint(tmp_path, layers, prefix="model.language_model".replace(".layers", ""))
    perm = torch.tensor([3, 1, 0, 2, 7, 5, 6, 4])
    check_layer(tmp_path, 0, layers[0], map_=perm)


def test_missing_layer_expert_and_corrupt_files(tmp_path):
    layers = [random_experts(E, H, I, dtype=torch.float32, seed=1)]
    write_checkpoint(tmp_path, layers)
    w = make_wrapper(layer_idx=5, e=E, k=K, h=H, i=I, weight_path=str(tmp_path))
    with pytest.raises(ValueError, match="no experts of layer 5"):
        w.load_weights(None)
    small = tmp_path / "small"
    small.mkdir()
    write_checkpoint(small, [tuple(t[:4] for t in layers[0])])
    w = make_wrapper(e=E, k=K, h=H, i=I, weight_path=str(small))
    with pytest.raises(ValueError, match="expert 4 is missing"):
        w.load_weights(None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    w = make_wrapper(e=E, k=K, h=H, i=I, weight_path=str(bad))
    with pytest.raises(ValueError, match="safetensors"):
        w.load_weights(None)
    # A truncated shard: header promises more bytes than the file has.
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    write_checkpoint(trunc, layers)
    f = trunc / "model-00001-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    w = make_wrapper(e=E, k=K, h=H, i=I, weight_path=str(trunc))
    with pytest.raises(ValueError):
        w.load_weights(None)


def test_wrong_shapes_in_checkpoint(tmp_path):
    layers = [random_experts(E, H, I, dtype=torch.float32, seed=2)]
    write_checkpoint(tmp_path, layers)
    w = make_wrapper(e=E, k=K, h=H, i=64, weight_path=str(tmp_path))  # file has I=96
    with pytest.raises(ValueError, match="expected 64x64"):
        w.load_weights(None)


def test_int8_checkpoint_is_rejected_by_name(tmp_path):
    g = torch.zeros(I, H, dtype=torch.int8)
    tensors = {}
    for e in range(E):
        for n in ("gate", "up"):
            tensors[f"model.layers.0.mlp.experts.{e}.{n}_proj.weight"] = g.clone()
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = g.T.contiguous().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = make_wrapper(e=E, k=K, h=H, i=I, weight_path=str(tmp_path))
    with pytest.raises(TypeError, match="I8"):
        w.load_weights(None)


def fp8_block_quantize(w):
    """DeepSeek-V3 style: e4m3 values and F32 `weight_scale_inv` per 128x128 block (amax/448)."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    scale = torch.zeros(br, bc)
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s = blk.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q, scale):
    s = scale.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    return q.float() * s


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4"])
def test_block_fp8_checkpoints(tmp_path, method):
    # I = 256 and H = 192: full and partial 128-blocks; AMXINT4 needs multiples of 128.
    e, h, i = 4, 256 if method == "AMXINT4" else 192, 256
    g, u, d = random_experts(e, h, i, dtype=torch.float32, seed=11)
    tensors, deq = {}, {"gate": [], "up": [], "down": []}
    for x in range(e):
        for name, t in (("gate", g[x]), ("up", u[x]), ("down", d[x])):
            q, s = fp8_block_quantize(t)
            key = f"model.layers.3.mlp.experts.{x}.{name}_proj.weight"
            tensors[key], tensors[key + "_scale_inv"] = q, s
            deq[name].append(fp8_dequantize(q, s))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    gd, ud, dd = (torch.stack(deq[n]) for n in ("gate", "up", "down"))
    w = make_wrapper(layer_idx=3, e=e, k=2, h=h, i=i, method=method, weight_path=str(tmp_path))
    w.load_weights(torch.arange(e))
    x = torch.randn(5, h)
    ids, wt = random_routing(5, e, 2, seed=2)
    err = rel_l2(w.forward(x, ids, wt, None), reference_moe(x, ids, wt, gd, ud, dd))
    assert err < {"BF16": 5e-3, "AMXINT8": 0.027, "AMXINT4": 0.27}[method], err


def test_fp8_without_block_scales_is_refused(tmp_path):
    g, u, d = random_experts(2, 64, 64, dtype=torch.float32, seed=1)
    tensors = {}
    for x in range(2):
        for name, t in (("gate", g[x]), ("up", u[x]), ("down", d[x])):
            tensors[f"model.layers.0.mlp.experts.{x}.{name}_proj.weight"] = t.to(
                torch.float8_e4m3fn
            )
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = make_wrapper(e=2, k=2, h=64, i=64, weight_path=str(tmp_path))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        w.load_weights(torch.arange(2))
