"""Native-format experts handed to the low-level classes by address, as the original's
``NativeMoEWrapper.load_weights`` does: ``config.gate_projs``/``gate_scales``... hold one
address per expert of the tensor its loader leaves in memory, ``quant_config.group_size`` the
group. Each fixture checkpoint (written for the original, ``shared/fixtures/native-more``) is
loaded that way and must compute what a load of the same file computes, and stay within the
original's own error of its recorded outputs."""

from __future__ import annotations

from pathlib import Path

import kt_kernel  # noqa: F401  (registers kt_kernel_ext)
import kt_kernel_ext
import pytest
import torch
from conftest import make_wrapper
from kt_kernel.utils import loader
from kt_kernel_ext.moe import MOEConfig
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "native-more"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")
E, K, H, I = 4, 2, 128, 256  # noqa: E741 (the MoE shape letters)
LAYER = 1
PROJ = ("gate", "up", "down")


LOADERS = {
    "bf16": loader.BF16SafeTensorLoader,
    "fp8": loader.FP8SafeTensorLoader,
    "fp8_perchannel": loader.FP8SafeTensorLoader,
    "rawint4": loader.CompressedSafeTensorLoader,
    "gptq_int4": loader.GPTQSafeTensorLoader,
    "mxfp4": loader.MXFP4SafeTensorLoader,
    "nvfp4": loader.NVFP4SafeTensorLoader,
    "mxfp8": loader.MXFP8SafeTensorLoader,
}


def _original_loader(method):
    """Per-expert (weight, scale) tensors of every projection, read by the loader the
    original's NativeMoEWrapper uses for ``method``, and the group size it derives."""
    found = LOADERS[method](str(FIXTURES / method)).load_experts(f"model.layers.{LAYER}")
    scales = {p: found.get(f"{p}_scale", [None] * E) for p in PROJ}
    out = {p: list(zip(found[p], scales[p], strict=True)) for p in PROJ}
    s = scales["gate"][0]
    group = {
        "fp8": 128,
        "gptq_int4": 0 if s is None else H // s.shape[0],  # scales [K/group, N]
    }.get(method, 0 if s is None or s.dim() < 2 else H // s.shape[1])
    return out, group


CLASSES = {
    "bf16": ("AMXBF16_MOE", "BF16"),
    "fp8": ("AMXFP8_MOE", "FP8"),
    "fp8_perchannel": ("AMXFP8PerChannel_MOE", "FP8_PERCHANNEL"),
    "rawint4": ("AMXInt4_KGroup_MOE", "RAWINT4"),
    "gptq_int4": ("AVX2GPTQInt4_MOE", "GPTQ_INT4"),
    "mxfp4": ("AMXFP4_KGroup_MOE", "MXFP4"),
    "nvfp4": ("AVX2MXFP4_MOE", "NVFP4"),  # the original runs NVFP4 on its FP4 class, group 16
    "mxfp8": ("AMXMXFP8_KGroup_MOE", "MXFP8"),
}


def _by_address(method, cpu_infer, tensors, group, cls=None):
    config = MOEConfig(E, K, H, I, 0)
    config.layer_idx = LAYER
    config.pool = cpu_infer.backend_
    config.max_len = 16
    for proj in PROJ:
        setattr(config, f"{proj}_projs", [[w.data_ptr() for w, _ in tensors[proj]]])
        scales = [[0 if s is None else s.data_ptr() for _, s in tensors[proj]]]
        setattr(config, f"{proj}_scales", scales)
    config.quant_config.group_size = group
    moe = getattr(kt_kernel_ext.moe, cls or CLASSES[method][0])(config)
    identity = torch.arange(E, dtype=torch.int64)  # alive until the task has run
    cpu_infer.submit(moe.load_weights_task(identity.data_ptr()))
    cpu_infer.sync()
    return moe


def _io(method, t):
    with safe_open(str(FIXTURES / f"io-{method}.safetensors"), "pt") as f:
        g = f.get_tensor
        return g(f"x.T{t}"), g(f"ids.T{t}"), g(f"weights.T{t}"), g(f"out.tp1.T{t}")


def _run(moe, x, ids, w):
    out = torch.zeros(x.shape[0], H, dtype=torch.bfloat16)
    bsz = torch.tensor([x.shape[0]], dtype=torch.int32)
    ids, w = ids.to(torch.int64).contiguous(), w.float().contiguous()
    moe.forward(bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr())
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("method", list(CLASSES))
def test_experts_by_address_compute_what_the_file_computes(method):
    tensors, group = _original_loader(method)
    cpu_infer = kt_kernel_ext.CPUInfer(2)
    moe = _by_address(method, cpu_infer, tensors, group)
    path = str(FIXTURES / method)
    wrapper = make_wrapper(
        layer_idx=LAYER, e=E, k=K, h=H, i=I, chunk=16, method=CLASSES[method][1], weight_path=path
    )
    wrapper.load_weights(torch.arange(E))
    for t in (1, 7):
        x, ids, w, original = _io(method, t)
        ours = _run(moe, x, ids, w)
        if method == "nvfp4":
            # bf16-folded scales are not NVFP4's E4M3 x per-tensor scale: the same numbers to
            # bf16 precision of the scale, not the same bits.
            assert _rel(ours, wrapper.forward(x, ids, w)) < 1e-2
        else:
            assert torch.equal(ours, wrapper.forward(x, ids, w)), (method, t)
        # The original's own error on these fixtures is 4e-3 to 1.2e-2 (summary.json).
        assert _rel(ours, original) < 2e-2, (method, t, _rel(ours, original))
    # 16 rows on each of two experts: the many-row (prefill, AMX where usable) kernels.
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(16, H, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 16)
    w = torch.rand(16, K, generator=g)
    ours, theirs = _run(moe, x, ids, w), wrapper.forward(x, ids, w)
    assert torch.equal(ours, theirs) if method != "nvfp4" else _rel(ours, theirs) < 1e-2


def test_bad_addresses_are_refused_clearly():
    tensors, group = _original_loader("rawint4")
    cpu_infer = kt_kernel_ext.CPUInfer(1)
    with pytest.raises(ValueError, match="group_size 48"):
        _by_address("rawint4", cpu_infer, tensors, 48)
    missing = dict(tensors, down=[(w, None) for w, _ in tensors["down"]])
    with pytest.raises(ValueError, match="scale tensor but its address is null"):
        _by_address("rawint4", cpu_infer, missing, group)
    short = dict(tensors, up=tensors["up"][:3])
    with pytest.raises(ValueError, match="holds 3 addresses; expert_num is 4"):
        _by_address("rawint4", cpu_infer, short, group)
    gptq, g = _original_loader("gptq_int4")
    s = gptq["gate"][0][1]
    s[0, 0] = 1.0 + 2**-20  # not an fp16 number
    with pytest.raises(ValueError, match="not an fp16 value"):
        _by_address("gptq_int4", cpu_infer, gptq, g)
    with pytest.raises(NotImplementedError, match="not taken by address"):
        _by_address("bf16", cpu_infer, _original_loader("bf16")[0], 0, cls="MOE")


def test_gptq_loader_refuses_what_it_would_read_wrongly(tmp_path):
    from native_checkpoints import GPTQ_CONFIG, layer_tensors, prefix
    from safetensors.torch import save_file

    e, h, i = 2, 128, 256
    g = torch.Generator().manual_seed(0)
    shapes = ((e, i, h), (e, i, h), (e, h, i))
    gate, up, down = ((torch.randn(*s, generator=g) * 0.05).bfloat16() for s in shapes)

    def load(folder, extra=None, config=GPTQ_CONFIG):
        tensors = layer_tensors("GPTQ_INT4", 0, gate, up, down)
        tensors.update(extra or {})
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(config)
        return loader.GPTQSafeTensorLoader(str(folder)).load_experts("model.layers.0")

    # Flags written as strings read as their values: "false" is not a refusal.
    assert len(load(tmp_path / "strings", config=GPTQ_CONFIG.replace("false", '"false"'))["up"])
    gate0, down0 = prefix("GPTQ_INT4", 0, 0, "gate"), prefix("GPTQ_INT4", 0, 0, "down")
    zeros = {f"{gate0}.qzeros": torch.full((1, i // 8), 0x33333333, dtype=torch.int32)}
    with pytest.raises(NotImplementedError, match="asymmetric"):
        load(tmp_path / "asym", zeros)
    order = {f"{down0}.g_idx": (torch.arange(i).flip(0) // 128).int()}
    with pytest.raises(NotImplementedError, match="activation-order"):
        load(tmp_path / "order", order)
