"""The public surface matches the original kt_kernel (names, signature, methods, statics)."""

from __future__ import annotations

import inspect
import sys

import kt_kernel
import pytest
import torch
from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks

ORIGINAL_ORDER = [
    "layer_idx",
    "num_experts",
    "num_experts_per_tok",
    "hidden_size",
    "moe_intermediate_size",
    "gpu_experts_mask",
    "cpuinfer_threads",
    "threadpool_count",
    "weight_path",
    "chunked_prefill_size",
    "cpu_save",
    "max_deferred_experts_per_token",
    "method",
    "numa_nodes",
    "mode",
    "num_gpu_experts",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "max_cache_depth",
    "group_size",
    "zero_point",
    "full_weight_grad",
    "swiglu_limit",
    "swiglu_alpha",
]
ORIGINAL_DEFAULTS = {
    "cpu_save": False,
    "max_deferred_experts_per_token": None,
    "method": "AMXINT4",
    "numa_nodes": None,
    "mode": "inference",
    "num_gpu_experts": 0,
    "lora_rank": 16,
    "lora_alpha": 32.0,
    "lora_dropout": 0.0,
    "max_cache_depth": 1,
    "group_size": 128,
    "zero_point": True,
    "full_weight_grad": False,
    "swiglu_limit": 0.0,
    "swiglu_alpha": 0.0,
}


def test_signature_order_and_defaults():
    params = list(inspect.signature(KTMoEWrapper.__new__).parameters.values())[1:]
    names = [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert names == ORIGINAL_ORDER
    by_name = {p.name: p for p in params}
    for name, default in ORIGINAL_DEFAULTS.items():
        assert by_name[name].default == default, name


def test_required_arguments_are_still_required():
    with pytest.raises(TypeError, match="weight_path"):
        KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, chunked_prefill_size=8, method="BF16")


def test_module_attributes():
    for name in kt_kernel.__all__:
        assert hasattr(kt_kernel, name), name
    assert kt_kernel.__cpu_variant__ in {
        "amx",
        "avx512_bf16",
        "avx512_vbmi",
        "avx512_vnni",
        "avx512_base",
        "avx2",
        "generic",
    }
    assert kt_kernel.__int8_weight_layout__ == "kt-int8-n32-k64-vnni-v1"
    assert kt_kernel.AMXSFTMoEWrapper is None
    assert sys.modules["kt_kernel_ext"] is kt_kernel.kt_kernel_ext
    assert kt_kernel.kt_kernel_ext.__cpu_variant__ == kt_kernel.__cpu_variant__
    info = kt_kernel.cpu_info()
    assert info["variant"] == kt_kernel.__cpu_variant__
    assert info["physical_cores"] >= 1 and "BF16" in info["kernels"]
    assert kt_kernel.build_info()["version"] == kt_kernel.__version__


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="BF16") as e:
        KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, "", 8, method="BF17")
    assert "AMXINT4" in str(e.value)


@pytest.mark.parametrize("method", ["SYCL_GPTQ_INT4", "MOE_INT4", "MOE_INT8"])
def test_known_but_unbuilt_methods_raise_not_implemented(method):
    with pytest.raises(NotImplementedError, match=method):
        KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, "", 8, method=method)


def test_sft_mode_and_bad_mode():
    with pytest.raises(NotImplementedError):
        KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, "", 8, mode="sft", method="AMXBF16_SFT")
    with pytest.raises(ValueError, match="mode"):
        KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, "", 8, mode="train", method="BF16")


def test_factory_returns_backend_and_attributes():
    w = KTMoEWrapper(3, 8, 2, 64, 64, None, 2, 1, "", 16, method="BF16", num_gpu_experts=3)
    assert type(w).__name__ == "NativeMoEWrapper"
    assert w.layer_idx == 3 and w.num_experts == 8 and w.method == "BF16"
    assert (
        w.num_gpu_experts == 3 and w.gpu_experts_mask[:3].all() and not w.gpu_experts_mask[3:].any()
    )
    assert w.max_deferred_experts_per_token == 0
    assert hasattr(w.cpu_infer, "sync") and w.moe is not None


def test_capture_batch_sizes_round_trip():
    old = KTMoEWrapper.get_capture_batch_sizes()
    try:
        KTMoEWrapper.set_capture_batch_sizes([4, 1, 2, 4])
        assert KTMoEWrapper.get_capture_batch_sizes() == [1, 2, 4]
    finally:
        KTMoEWrapper.set_capture_batch_sizes(old)


def test_generate_gpu_experts_masks():
    freq = torch.tensor([[5.0, 1.0, 3.0], [4.0, 9.0, 0.0]])
    m = generate_gpu_experts_masks(freq, 3)
    assert m.dtype == torch.bool and m.shape == (2, 3)
    assert m.tolist() == [[True, False, False], [True, True, False]]
    assert generate_gpu_experts_masks(freq, 0).sum() == 0
    assert generate_gpu_experts_masks(freq, 100).all()
    # Ties go to the lower (layer, expert) index, deterministically.
    ties = generate_gpu_experts_masks(torch.ones(2, 2), 3)
    assert ties.tolist() == [[True, True], [True, False]]
    with pytest.raises(ValueError):
        generate_gpu_experts_masks(torch.ones(4), 1)


def test_cpuinfer_compat_layer():
    ext = kt_kernel.kt_kernel_ext
    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count = 1
    cfg.subpool_numa_map = [0]
    cfg.subpool_thread_count = [1]
    ci = ext.CPUInfer(cfg, pin=False)
    ci.sync()
    ci.sync_with_cuda_stream(0)
    with pytest.raises(ValueError):
        ext.CPUInfer(0)
    with pytest.raises(TypeError):
        ext.CPUInfer("four")


def test_kt_version_agrees_with_the_package_and_the_checkout():
    import json
    import re
    import subprocess
    from importlib import metadata
    from pathlib import Path

    r = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "version", "--json"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["package"] == metadata.version("kt-kernel") == kt_kernel.__version__
    assert facts["extension"] == facts["core"] == kt_kernel.__version__
    assert facts["profile"] in ("release", "debug")
    rev = facts["git_revision"]
    assert rev == "unknown" or re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", rev), rev
    # Built from this checkout: the revision is its HEAD (when git can tell).
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
    )
    if head.returncode == 0 and rev != "unknown":
        assert rev.split("+")[0] == head.stdout.strip(), (rev, head.stdout)
    text = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "version"], capture_output=True, text=True
    ).stdout
    assert text.startswith(f"kt_kernel {kt_kernel.__version__}") and rev in text, text
