"""Scripts written against the original's documented low-level API (``kt_kernel_ext``:
``CPUInfer``, ``moe.MOEConfig``, the ``*_MOE`` classes and their ``*_task`` methods), as its
own per-commit tests drive it, run on CPU tensors and agree with ``KTMoEWrapper`` and a
float64 reference."""

from __future__ import annotations

import json

import kt_kernel  # noqa: F401  (registers the top-level kt_kernel_ext name)
import kt_kernel_ext
import pytest
import torch
from conftest import make_wrapper, random_routing, reference_moe
from kt_kernel import convert
from kt_kernel_ext.moe import MOEConfig
from safetensors.torch import save_file

E, K, H, I = 8, 2, 256, 256  # noqa: E741 (the MoE shape letters)
MAX_LEN = 16


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    return mk(E, I, H), mk(E, I, H), mk(E, H, I)


def _original_style_layer(cls_name, cpu_infer, gate, up, down, layer_idx=0, path=""):
    """What the original's tests do: a config with raw pointers, then load and warm up."""
    config = MOEConfig(E, K, H, I, 0)
    config.layer_idx = layer_idx
    config.pool = cpu_infer.backend_
    config.max_len = MAX_LEN
    config.gate_proj, config.up_proj, config.down_proj = (t.data_ptr() for t in (gate, up, down))
    config.path = path
    moe = getattr(kt_kernel_ext.moe, cls_name)(config)
    physical_to_logical = torch.arange(E, dtype=torch.int64)
    cpu_infer.submit(moe.load_weights_task(physical_to_logical.data_ptr()))
    cpu_infer.sync()
    cpu_infer.submit(moe.warm_up_task())
    cpu_infer.sync()
    return moe


def _buffers(tokens, seed=1):
    ids, w = random_routing(tokens, E, K, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, H, generator=g) * 0.5).to(torch.bfloat16)
    return (
        torch.tensor([tokens], dtype=torch.int32),
        ids.to(torch.int64).contiguous(),
        w.float().contiguous(),
        x,
        torch.zeros(tokens, H, dtype=torch.bfloat16),
    )


@pytest.mark.parametrize(
    "cls_name, method, budget",
    [("AMXBF16_MOE", "BF16", 1e-2), ("AVX2BF16_MOE", "BF16", 1e-2),
     ("AMXInt8_MOE", "AMXINT8", 4e-2), ("AMXInt4_MOE", "AMXINT4", 0.3)],
)  # fmt: skip
def test_forward_task_equals_the_wrapper_and_tracks_the_reference(cls_name, method, budget):
    gate, up, down = _weights()
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    moe = _original_style_layer(cls_name, cpu_infer, gate, up, down)
    bsz, ids, w, x, out = _buffers(5)
    task = moe.forward_task(
        bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr(), False
    )
    cpu_infer.submit(task)
    cpu_infer.sync()
    wrapper = make_wrapper(e=E, k=K, h=H, i=I, method=method)
    wrapper.load_weights_from_tensors(gate, up, down, torch.arange(E))
    assert torch.equal(out, wrapper.forward(x, ids, w))
    ref = reference_moe(x, ids, w, gate, up, down)
    # The measure of the original's tests, mean |out - ref| / mean |ref| (per-row int4 is coarse).
    err = ((out.double() - ref).abs().mean() / ref.abs().mean()).item()
    assert err < budget, err


def test_the_token_count_is_read_when_the_task_runs():
    gate, up, down = _weights(seed=3)
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    moe = _original_style_layer("AMXBF16_MOE", cpu_infer, gate, up, down, layer_idx=1)
    bsz, ids, w, x, out = _buffers(6, seed=4)
    ptrs = (bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr())
    task = moe.forward_task(*ptrs)
    assert moe.forward_task(*ptrs) == task  # one descriptor per argument set
    bsz.fill_(2)
    cpu_infer.submit(task)
    cpu_infer.sync()
    ref = reference_moe(x, ids, w, gate, up, down)
    assert out[2:].abs().sum() == 0, "rows beyond the cell's count must stay untouched"
    assert ((out[:2].double() - ref[:2]).norm() / ref[:2].norm()).item() < 1e-2
    bsz.fill_(6)
    moe.forward(*ptrs)  # the direct form
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    bsz.fill_(MAX_LEN + 1)
    cpu_infer.submit(task)
    with pytest.raises(ValueError, match="batch-size cell holds 17"):
        cpu_infer.sync()


@pytest.mark.parametrize("cls_name", ["AMXBF16_MOE", "AMXInt8_MOE"])
def test_incremental_adds_what_the_output_buffer_holds(cls_name):
    """The original's deferred-experts step: layer L+1's task runs with incremental=True and
    adds the bf16 partial that layer L's deferred task left in the same buffer."""
    gate, up, down = _weights(seed=11)
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    moe = _original_style_layer(cls_name, cpu_infer, gate, up, down)
    bsz, ids, w, x, plain = _buffers(7, seed=12)
    args = lambda out: (bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(),  # noqa: E731
                        out.data_ptr())  # fmt: skip
    moe.forward(*args(plain), False)
    before = (torch.randn(7, H, generator=torch.Generator().manual_seed(13))).to(torch.bfloat16)
    out = before.clone()
    cpu_infer.submit(moe.forward_task(*args(out), True))
    cpu_infer.sync()
    want = plain.double() + before.double()
    # One bf16 rounding of the sum (plus the plain result's own rounding).
    assert ((out.double() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    assert not torch.equal(out, plain) and not torch.equal(out, before)
    again = before.clone()
    moe.forward(*args(again), True)  # the direct form, and the same result
    assert torch.equal(again, out)


def test_amxint8_from_converted_files_by_path(tmp_path):
    gate, up, down = _weights(seed=5)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = {}
    for e in range(E):
        for name, m in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = m.contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"))
    config = {"hidden_size": H, "moe_intermediate_size": I, "num_experts": E}
    (ckpt / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": K}))
    out_dir = tmp_path / "int8"
    args = ["-i", str(ckpt), "-o", str(out_dir), "--quant-method", "int8"]
    assert convert.main([*args, "--threadpool-count", "1", "-q"]) == 0
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    empty = torch.empty(0, dtype=torch.bfloat16)
    moe = _original_style_layer("AMXInt8_MOE", cpu_infer, empty, empty, empty, path=str(out_dir))
    bsz, ids, w, x, out = _buffers(3, seed=6)
    moe.forward(bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr())
    online = make_wrapper(e=E, k=K, h=H, i=I, method="AMXINT8")
    online.load_weights_from_tensors(gate, up, down, torch.arange(E))
    assert torch.equal(out, online.forward(x, ids, w))


@pytest.mark.parametrize("method, parts", [("int8", 1), ("int8", 2), ("int4", 2)])
def test_converted_tensors_by_address_as_the_originals_amx_wrapper_passes_them(
    tmp_path, method, parts
):
    """The original's AMX wrapper over merged converted files: SafeTensorLoader.load_experts
    ("blk.L") gives [numa][expert] arrays, their addresses go into gate_projs/gate_scales."""
    from kt_kernel.utils.loader import SafeTensorLoader

    gate, up, down = _weights(seed=14)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = {
        f"model.layers.0.mlp.experts.{e}.{name}.weight": m[e].contiguous()
        for e in range(E)
        for name, m in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
    }
    save_file(tensors, str(ckpt / "model.safetensors"))
    config = {"hidden_size": H, "moe_intermediate_size": I, "num_experts": E}
    (ckpt / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": K}))
    out_dir = tmp_path / method
    args = ["-i", str(ckpt), "-o", str(out_dir), "--quant-method", method]
    assert convert.main([*args, "--threadpool-count", str(parts), "-q"]) == 0
    pools = kt_kernel_ext.WorkerPoolConfig()
    pools.subpool_count, pools.subpool_numa_map = parts, [0] * parts
    pools.subpool_thread_count = [2 // parts] * parts
    cpu_infer = kt_kernel_ext.CPUInfer(pools)
    cls = {"int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}[method]
    arrays = SafeTensorLoader(str(out_dir)).load_experts("blk.0")
    config = MOEConfig(E, K, H, I, 0)
    config.pool, config.max_len = cpu_infer.backend_, MAX_LEN
    for proj in ("gate", "up", "down"):
        ptrs = lambda key: [[a.ctypes.data for a in numa] for numa in arrays[key]]  # noqa: E731
        setattr(config, f"{proj}_projs", ptrs(proj))
        setattr(config, f"{proj}_scales", ptrs(f"{proj}_scale"))
    by_address = getattr(kt_kernel_ext.moe, cls)(config)
    by_address.load_weights()
    empty = torch.empty(0, dtype=torch.bfloat16)
    by_path = _original_style_layer(cls, cpu_infer, empty, empty, empty, path=str(out_dir))
    bsz, ids, w, x, out = _buffers(9, seed=15)
    ref_out = out.clone()
    ptrs = (bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr())
    by_address.forward(*ptrs, out.data_ptr())
    by_path.forward(*ptrs, ref_out.data_ptr())
    assert torch.equal(out, ref_out) and out.abs().sum() > 0
    config.gate_projs = config.gate_projs[:1] * (3 - parts)  # the other NUMA split
    with pytest.raises(ValueError, match="NUMA entries"):
        getattr(kt_kernel_ext.moe, cls)(config).load_weights()


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")])
def test_gguf_tensors_by_address_as_the_originals_llamafile_wrapper_passes_them(tmp_path, types):
    """The original's LLAMAFILE wrapper: GGUFLoader's raw [E, I, H] block tensors and ggml type
    ids in gate_proj/gate_type..., then MOE(config)."""
    from kt_kernel.utils.loader import GGUFLoader
    from test_llamafile import build_gguf

    path = str(tmp_path / "m.gguf")
    build_gguf(path, types=types, layer=1, e=E, h=H, i=I)
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    raw = [
        GGUFLoader(path).get_undequanted_tensor_and_ggml_type(f"blk.1.ffn_{p}_exps.weight")
        for p in ("gate", "up", "down")
    ]
    config = MOEConfig(E, K, H, I, 0)
    config.layer_idx, config.pool, config.max_len = 1, cpu_infer.backend_, MAX_LEN
    config.gate_proj, config.up_proj, config.down_proj = (t.data_ptr() for t, _ in raw)
    config.gate_type, config.up_type, config.down_type = (ty for _, ty in raw)
    by_address = kt_kernel_ext.moe.MOE(config)
    by_address.load_weights()
    empty = torch.empty(0, dtype=torch.bfloat16)
    by_path = _original_style_layer("MOE", cpu_infer, empty, empty, empty, 1, path)
    bsz, ids, w, x, out = _buffers(9, seed=16)
    ref_out = out.clone()
    ptrs = (bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr())
    by_address.forward(*ptrs, out.data_ptr())
    by_path.forward(*ptrs, ref_out.data_ptr())
    assert torch.equal(out, ref_out) and out.abs().sum() > 0
    config.gate_type = 255
    with pytest.raises(ValueError, match="not a ggml type id"):
        kt_kernel_ext.moe.MOE(config).load_weights()
    config.gate_type, config.hidden_type = raw[0][1], 0
    with pytest.raises(NotImplementedError, match="activations are bf16"):
        kt_kernel_ext.moe.MOE(config).load_weights()


def test_unsupported_inputs_are_refused_clearly():
    gate, up, down = _weights()
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    config = MOEConfig(E, K, H, I, 0)
    with pytest.raises(ValueError, match="backend_"):
        kt_kernel_ext.moe.AMXFP8_MOE(config)
    config.pool = cpu_infer.backend_
    config.gate_proj, config.up_proj, config.down_proj = (t.data_ptr() for t in (gate, up, down))
    fp8 = kt_kernel_ext.moe.AMXFP8_MOE(config)
    with pytest.raises(NotImplementedError, match="config.path"):
        fp8.load_weights()
    moe = _original_style_layer("AMXBF16_MOE", cpu_infer, gate, up, down)
    bsz, ids, w, x, out = _buffers(2)
    ptrs = (bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr())
    with pytest.raises(ValueError, match="k=3"):
        moe.forward_task(ptrs[0], 3, *ptrs[2:])
    with pytest.raises(TypeError):
        cpu_infer.submit("not a task")


def test_config_overloads_and_module_names():
    assert MOEConfig(E, K, H, I, 3).num_gpu_experts == 3
    mask = torch.zeros(E, dtype=torch.bool)
    big = MOEConfig(E, K, H, I, 2**40)
    assert big.gpu_experts_mask == 2**40 and big.num_gpu_experts == 0
    assert mask.numel() == E
    import sys

    assert sys.modules["kt_kernel_ext"] is kt_kernel.kt_kernel_ext
    assert sys.modules["kt_kernel_ext.moe"] is kt_kernel_ext.moe
    q = kt_kernel_ext.QuantConfig()
    assert (q.quant_method, q.bits, q.group_size) == ("", 0, 0)


def test_write_weight_scale_to_buffer_task_writes_the_wrappers_bytes():
    gate, up, down = _weights(seed=8)
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    moe = _original_style_layer("AMXBF16_MOE", cpu_infer, gate, up, down, layer_idx=2)
    wrapper = make_wrapper(layer_idx=3, e=E, k=K, h=H, i=I, method="BF16")
    wrapper.load_weights_from_tensors(gate, up, down, torch.arange(E))
    tp = 2
    sizes = moe.layer.gpu_rank_bytes(tp)

    def buffers():
        bufs = [[torch.zeros(n, dtype=torch.uint8) for _ in range(tp)] for n in sizes]
        return bufs, [[b.data_ptr() for b in ranks] for ranks in bufs]

    ours, ptrs = buffers()
    cpu_infer.submit(moe.write_weight_scale_to_buffer_task(tp, 5, *ptrs))
    cpu_infer.sync()
    theirs, wptrs = buffers()
    wrapper.submit_write_weight_scale_to_buffer(tp, 5, *wptrs)
    wrapper.sync_write_weight_scale_to_buffer()
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y) and (x.numel() == 0 or x.any())  # BF16: no scales
    amx = _original_style_layer("AMXInt8_MOE", cpu_infer, gate, up, down, layer_idx=4)
    with pytest.raises(NotImplementedError):
        amx.write_weight_scale_to_buffer_task(1, 0, [1], [1], [1], [1])
