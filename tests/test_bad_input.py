"""Bad input raises a clear Python exception, never a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_wrapper, random_experts, random_routing, reference_moe, rel_l2


def test_bad_shapes_at_construction():
    with pytest.raises(ValueError, match="hidden_size=100"):
        make_wrapper(h=100)
    with pytest.raises(ValueError, match="moe_intermediate_size=40"):
        make_wrapper(i=40)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        make_wrapper(e=4, k=5)
    with pytest.raises(ValueError, match="gpu_experts_mask"):
        make_wrapper(e=8, gpu_experts_mask=torch.zeros(7, dtype=torch.bool))
    # A float mask would turn 0.5 into True (every expert on the GPU, nothing on the CPU).
    with pytest.raises(TypeError, match="gpu_experts_mask must hold bools"):
        make_wrapper(e=8, gpu_experts_mask=torch.full((8,), 0.5))
    with pytest.raises(ValueError, match="1-D"):
        make_wrapper(e=8, gpu_experts_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError):
        make_wrapper(layer_idx="0")
    with pytest.raises(ValueError, match="numa_nodes"):
        make_wrapper(numa_nodes=[0, 1])
    with pytest.raises(ValueError, match="swiglu_limit"):
        make_wrapper(swiglu_limit=float("nan"))


def test_bad_weight_tensors():
    w = make_wrapper(e=8, h=64, i=96)
    g, u, d = random_experts(8, 64, 96)
    with pytest.raises(ValueError, match="down_proj"):
        w.load_weights_from_tensors(g, u, g)  # [E, I, H] given where [E, H, I] belongs
    g2, u2, d2 = random_experts(8, 128, 96)  # wrong hidden size
    with pytest.raises(ValueError, match="gate_proj"):
        w.load_weights_from_tensors(g2, u2, d2)
    with pytest.raises(TypeError, match="dtype"):
        w.load_weights_from_tensors(g, u, d.to(torch.float32))
    with pytest.raises(TypeError):
        w.load_weights_from_tensors(g.to(torch.int8), u.to(torch.int8), d.to(torch.int8))
    with pytest.raises(ValueError, match="num_experts"):
        w.load_weights_from_tensors(g[:4], u[:4], d[:4])
    with pytest.raises(TypeError, match="physical_to_logical_map"):
        w.load_weights_from_tensors(g, u, d, {"a": 1})
    with pytest.raises(ValueError, match="physical_to_logical_map"):
        w.load_weights_from_tensors(g, u, d, torch.arange(7))
    with pytest.raises(ValueError, match=r"map\[7\]=8"):
        w.load_weights_from_tensors(g, u, d, torch.arange(1, 9))


def test_forward_before_load_and_sync_without_submit():
    w = make_wrapper()
    x = torch.randn(2, 64)
    ids, wt = random_routing(2, 8, 2)
    with pytest.raises(RuntimeError, match="load_weights"):
        w.forward(x, ids, wt, None)
    with pytest.raises(RuntimeError, match="submit_forward"):
        w.sync_forward(x, None)


def test_bad_forward_arguments(small_layer):
    w, _ = small_layer
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ids, wt = random_routing(3, 8, 2)
    cases = [
        ((torch.randn(3, 65), ids, wt), ValueError, "hidden_size=64"),
        ((x.to(torch.int32), ids, wt), TypeError, "floating point"),
        ((x, ids.float(), wt), TypeError, "integer"),
        ((x, ids[:, :1], wt), ValueError, "topk_ids"),
        ((x, ids, wt[:2]), ValueError, "topk_weights"),
        ((x, ids, wt.to(torch.int64)), TypeError, "topk_weights"),
        ((torch.randn(65, 64), *random_routing(65, 8, 2)), ValueError, "chunked_prefill_size=64"),
        (("x", ids, wt), TypeError, "torch.Tensor"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            w.forward(*args, None)
    # A rebound mask of the wrong size is caught at the next forward.
    saved = w.gpu_experts_mask
    w.gpu_experts_mask = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="gpu_experts_mask"):
        w.forward(x, ids, wt, None)
    w.gpu_experts_mask = saved
    w.forward(x, ids, wt, None)  # still healthy


def test_negated_views_are_read_as_their_values(small_layer):
    # torch's neg bit: a lazily negated view reports contiguous while its memory holds the
    # values before negation, so a raw pointer would read them with the wrong sign.
    w, (gate, up, down) = small_layer
    x = torch.randn(3, 64)
    ids, wt = random_routing(3, 8, 2)
    want = w.forward(x, ids, wt).clone()
    neg = torch._neg_view
    assert neg(-x).is_neg() and neg(-x).is_contiguous()
    assert torch.equal(w.forward(neg(-x), neg(-ids), neg(-wt)), want)
    other = make_wrapper(layer_idx=5, e=8, k=2, h=64, i=96)
    other.load_weights_from_tensors(neg(-gate), neg(-up), neg(-down), neg(-torch.arange(8)))
    assert torch.equal(other.forward(x, ids, wt), want)


def test_error_inside_a_task_surfaces_at_sync(small_layer):
    w, _ = small_layer
    x = torch.randn(65, 64)
    ids, wt = random_routing(65, 8, 2)
    out = torch.empty_like(x)
    # The low-level call skips the Python checks: the native task fails, and the failure comes
    # back from the wait on its ticket, as a Python exception.
    ticket = w.moe.submit_forward(
        65,
        x.data_ptr(),
        "float32",
        ids.data_ptr(),
        "int64",
        wt.data_ptr(),
        out.data_ptr(),
        "float32",
    )
    with pytest.raises(ValueError, match="exceed chunked_prefill_size=64"):
        w.cpu_infer.engine.wait(ticket)
    w.forward(x[:3], ids[:3], wt[:3], None)  # the engine keeps working


def test_missing_weight_path():
    w = make_wrapper(weight_path="/nonexistent/kt")
    with pytest.raises(FileNotFoundError):
        w.load_weights(torch.arange(8))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env
    )


def test_cpu_variant_cap_can_only_lower():
    ok = _run("import kt_kernel; print(kt_kernel.__cpu_variant__)", KT_KERNEL_CPU_VARIANT="avx2")
    assert ok.returncode == 0 and ok.stdout.strip() == "avx2", ok.stderr
    bad = _run("import kt_kernel", KT_KERNEL_CPU_VARIANT="avx9000")
    assert bad.returncode != 0 and "not a known variant" in bad.stderr
    import kt_kernel

    if kt_kernel.cpu_info()["detected_variant"] != "amx":
        high = _run("import kt_kernel", KT_KERNEL_CPU_VARIANT="amx")
        assert high.returncode != 0 and "missing" in high.stderr and "amx" in high.stderr


def test_cpu_features_can_be_disabled_by_name():
    """KT_KERNEL_CPU_DISABLE marks features unusable (the kernels another CPU would pick) and
    refuses names it does not know."""
    show = (
        "import kt_kernel; i = kt_kernel.cpu_info(); "
        "print(i['flags']['avx_vnni'], i['kernels']['MXFP4'])"
    )
    off = _run(show, KT_KERNEL_CPU_VARIANT="avx2", KT_KERNEL_CPU_DISABLE="avx_vnni")
    assert off.returncode == 0 and off.stdout.split() == ["False", "int-avx2"], off.stderr
    import kt_kernel

    if kt_kernel.cpu_info()["flags"]["avx_vnni"]:
        on = _run(show, KT_KERNEL_CPU_VARIANT="avx2")
        assert on.returncode == 0 and on.stdout.split() == ["True", "int-avx-vnni"], on.stderr
    bad = _run("import kt_kernel", KT_KERNEL_CPU_DISABLE="avx_vnn")
    assert bad.returncode != 0 and "KT_KERNEL_CPU_DISABLE" in bad.stderr, bad.stderr
    assert "avx_vnni" in bad.stderr


LOWER_LEVEL_CHECK = """
import torch, sys
sys.path.insert(0, {tests!r})
from conftest import make_wrapper, random_experts, random_routing, reference_moe, rel_l2
import kt_kernel
g, u, d = random_experts(8, 64, 96, seed=11)
w = make_wrapper(e=8, k=2, i=96, threadpool_count={parts}, cpuinfer_threads=2)
w.load_weights_from_tensors(g, u, d)
x = torch.randn(9, 64)
ids, wt = random_routing(9, 8, 2)
err = rel_l2(w.forward(x, ids, wt, None), reference_moe(x, ids, wt, g, u, d))
kernel = kt_kernel.cpu_info()["kernels"]["BF16"]
print(kt_kernel.__cpu_variant__, kernel, w.cpu_infer.engine.parts, err)
assert err < 5e-3, err
"""


@pytest.mark.parametrize("variant", ["generic", "avx2", "avx512_base"])
@pytest.mark.parametrize("parts", [1, 2])
def test_every_runnable_variant_and_two_subpools_end_to_end(variant, parts):
    import kt_kernel

    order = ["generic", "avx2", "avx512_base", "avx512_vnni", "avx512_vbmi", "avx512_bf16", "amx"]
    if order.index(variant) > order.index(kt_kernel.cpu_info()["detected_variant"]):
        pytest.skip(f"{variant} not available on this CPU")
    tests = os.path.dirname(__file__)
    r = _run(LOWER_LEVEL_CHECK.format(tests=tests, parts=parts), KT_KERNEL_CPU_VARIANT=variant)
    assert r.returncode == 0, r.stderr
    got_variant, _kernel, got_parts, _ = r.stdout.split()
    assert got_variant == variant and int(got_parts) == parts


@pytest.mark.parametrize(
    ("var", "setting", "ok"),
    [
        ("KT_KERNEL_PANEL_PREFETCH", "0", True),
        ("KT_KERNEL_PANEL_PREFETCH", "16384:l2", True),
        ("KT_KERNEL_PANEL_PREFETCH", "lots", False),
        ("KT_KERNEL_FP8_SUBNORMALS", "exact", True),
        ("KT_KERNEL_FP8_SUBNORMALS", "zero", True),
        ("KT_KERNEL_FP8_SUBNORMALS", "sometimes", False),
    ],
)
def test_kernel_settings_read_inside_the_kernels_are_checked_at_layer_build(var, setting, ok):
    """Two settings the kernels read on their own (the prefill panels' prefetch, the fused FP8
    decode's subnormal codes): a good value runs the layer, a bad one is refused by name when
    the layer is built."""
    r = _run(LOWER_LEVEL_CHECK.format(tests=os.path.dirname(__file__), parts=1), **{var: setting})
    if ok:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode != 0 and f"{var}={setting!r}".replace("'", '"') in r.stderr, r.stderr
        assert "Traceback" in r.stderr and "Segmentation" not in r.stderr


@pytest.mark.parametrize("setting", ["0", "4096", "4096:l2", "lots", "4096:l3"])
def test_prefetch_setting_is_used_or_refused_clearly(setting):
    # Prefetching changes speed only: the same layer output with and without it.
    r = _run(
        LOWER_LEVEL_CHECK.format(tests=os.path.dirname(__file__), parts=1),
        KT_KERNEL_PREFETCH=setting,
    )
    if setting in ("lots", "4096:l3"):
        assert r.returncode != 0 and "KT_KERNEL_PREFETCH" in r.stderr, r.stderr
        assert "Traceback" in r.stderr and "Segmentation" not in r.stderr
        return
    assert r.returncode == 0, r.stderr
    import kt_kernel

    # The setting applies to every kernel family.
    code = (
        "import kt_kernel; from kt_kernel import _kt_core; i = kt_kernel.cpu_info(); "
        "print(i['prefetch_bytes'], i['prefetch_bytes_group_scaled'], i['prefetch_bytes_fp8'], "
        "i['prefetch_bytes_gguf'], *_kt_core.prefetch_state('MXFP4'), "
        "*_kt_core.prefetch_state('FP8'), *_kt_core.prefetch_state('LLAMAFILE'))"
    )
    r = _run(code, KT_KERNEL_PREFETCH=setting)
    bytes_ahead = setting.removesuffix(":l2")
    # (tuned, bytes, into L2): a setting from the environment is final as given.
    into_l2 = str(setting.endswith(":l2") and bytes_ahead != "0")
    state = ["True", bytes_ahead, into_l2]
    want = [bytes_ahead] * 4 + state * 3
    assert r.returncode == 0 and r.stdout.split() == want, (r.stdout, r.stderr)
    # Calibrated, each family picks 0 or 4096; a process whose decodes tuned a family may hold
    # any of the tuner's settings (0, 4096, 16384).
    info = kt_kernel.cpu_info()
    keys = ("prefetch_bytes", "prefetch_bytes_group_scaled", "prefetch_bytes_fp8")
    for key in (*keys, "prefetch_bytes_gguf"):
        assert info[key] in (0, 4096, 16384), (key, info[key])


def test_deferred_output_of_another_shape_is_not_added():
    # Layer indices are global: layer 0 of one model (H=64) defers experts; layer 1 of
    # another model (H=256) must neither read that [8, 64] buffer as [8, 256] nor add it.
    a = make_wrapper(layer_idx=0, e=8, k=4, h=64, i=64, max_deferred_experts_per_token=2)
    a.load_weights_from_tensors(*random_experts(8, 64, 64))
    b_weights = random_experts(8, 256, 64, seed=3)
    b = make_wrapper(layer_idx=1, e=8, k=4, h=256, i=64)
    b.load_weights_from_tensors(*b_weights)
    ids, wt = random_routing(8, 8, 4)
    x = torch.randn(8, 256)
    a.forward(torch.randn(8, 64), ids, wt)
    out = b.forward(x, ids, wt)
    assert rel_l2(out, reference_moe(x, ids, wt, *b_weights)) < 1e-2


def test_two_submits_at_a_captured_batch_size_keep_both_results(small_layer):
    w, weights = small_layer
    ids, wt = random_routing(4, 8, 2)
    x0, x1 = torch.randn(4, 64), torch.randn(4, 64)
    type(w).set_capture_batch_sizes([4])
    try:
        w.submit_forward(x0, ids, wt)
        w.submit_forward(x1, ids, wt)
        out0 = w.sync_forward().clone()
        out1 = w.sync_forward()
    finally:
        type(w).set_capture_batch_sizes([])
    assert rel_l2(out0, reference_moe(x0, ids, wt, *weights)) < 1e-2
    assert rel_l2(out1, reference_moe(x1, ids, wt, *weights)) < 1e-2


def test_odd_arguments_are_refused_by_type_or_range(small_layer):
    w, (g, u, d) = small_layer
    with pytest.raises(ValueError, match="cpuinfer_threads must be <="):
        make_wrapper(cpuinfer_threads=1 << 40)
    with pytest.raises(ValueError, match="threadpool_count must be <="):
        make_wrapper(threadpool_count=1 << 40)
    with pytest.raises(ValueError, match="empty"):
        w.load_weights_from_tensors(g, u, d, torch.tensor([], dtype=torch.long))
    with pytest.raises(TypeError, match="batch size"):
        type(w).set_capture_batch_sizes([2.5])
    ids, wt = random_routing(2, 8, 2)
    with pytest.raises(TypeError, match="dense"):
        w.forward(torch.randn(2, 64).to_sparse(), ids, wt)
    with pytest.raises(TypeError, match="dense"):
        w.forward(torch.randn(2, 64), ids.to_sparse(), wt)
    # Zero tensors have no storage (their data pointer is 0).
    with pytest.raises(ValueError, match="zero tensor"):
        w.forward(torch._efficientzerotensor((2, 64)), ids, wt)
    with pytest.raises(ValueError, match="zero tensor"):
        w.forward(torch.randn(2, 64), ids, torch._efficientzerotensor((2, 2)))
    zero_gate = torch._efficientzerotensor(tuple(g.shape), dtype=g.dtype)
    with pytest.raises(ValueError, match="gate_proj is a zero tensor"):
        w.load_weights_from_tensors(zero_gate, u, d, torch.arange(8))


def test_native_pool_refuses_a_thread_storm():
    from kt_kernel import _kt_core

    with pytest.raises(ValueError, match="at most"):
        _kt_core.Engine([1 << 40], [0])
    with pytest.raises(ValueError, match="take"):
        _kt_core.ggml_dequantize("Q8_0", b"", 1 << 62)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("method", ["BF16", "LLAMAFILE"])
def test_named_pipe_as_weight_file_is_refused_not_waited_on(tmp_path, method):
    name = "model.safetensors" if method == "BF16" else "model.gguf"
    os.mkfifo(tmp_path / name)
    path = tmp_path if method == "BF16" else tmp_path / name
    kw = dict(e=8, k=2, h=256, i=256, method=method, weight_path=str(path))
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from conftest import make_wrapper
        w = make_wrapper(**{kw!r})
        try:
            w.load_weights(None if {method!r} == "LLAMAFILE" else torch.arange(8))
        except ValueError as e:
            print("refused:", e)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "not a regular file" in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("KT_SPIN_US", "abc", False),
        ("KT_SPIN_US", "100", True),
        # Beyond a second idle workers would never park: refused, not taken.
        ("KT_SPIN_US", "18446744073709551615", False),
        ("KT_SPIN_US", "1000001", False),
        # The round count it replaced is refused with the new name, not silently ignored.
        ("KT_SPIN_ROUNDS", "100", False),
        ("KT_KERNEL_AMX_EMULATE", "yes", False),
        ("KT_KERNEL_AMX_EMULATE", "0", True),
        ("KT_BF16_KERNEL", "", True),
    ],
)
def test_environment_settings_are_used_or_refused_by_name(name, value, ok):
    code = f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import make_wrapper, random_experts
        w = make_wrapper()
        w.load_weights_from_tensors(*random_experts(8, 64, 64))
        print(w.forward(torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long),
                        torch.ones(3, 2)).shape)
        """
    r = _run(code, **{name: value})
    if ok:
        assert r.returncode == 0 and "torch.Size([3, 64])" in r.stdout, r.stderr
    else:
        assert r.returncode != 0 and name in r.stderr and "ValueError" in r.stderr, r.stderr


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_K"])
def test_quantizing_beyond_the_fp16_scale_range_is_refused(ggml_type):
    from kt_kernel import _kt_core

    x = torch.full((256,), 3e38, dtype=torch.float32).numpy().tobytes()
    with pytest.raises(ValueError, match="fp16 range"):
        _kt_core.ggml_quantize(ggml_type, x)


def test_a_wrapper_asking_for_another_engine_configuration_is_warned():
    # One engine per process (as in the original): a later, different request is not used,
    # and says so instead of silently running with the first configuration.
    make_wrapper()
    with pytest.warns(RuntimeWarning, match="threadpool_count=2"):
        w = make_wrapper(threadpool_count=2)
    assert w.threadpool_count == 1


QUANTIZING_METHODS = [
    "AMXINT8",
    "AMXINT4",
    *"FP8 FP8_PERCHANNEL RAWINT4 GPTQ_INT4 MXFP4 NVFP4 MXFP8".split(),
]


@pytest.mark.parametrize("method", QUANTIZING_METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantizing_a_non_finite_weight_is_refused(method, bad):
    # NaN escapes a max over |w| (f32::max drops it), so it needs its own check.
    gate, up, down = random_experts(4, 256, 256, dtype=torch.float32)
    down[1, 3, 5] = bad
    w = make_wrapper(e=4, h=256, i=256, method=method)
    with pytest.raises(ValueError, match="non-finite"):
        w.load_weights_from_tensors(gate, up, down)


@pytest.mark.parametrize("method", ["MXFP4", "MXFP8"])
def test_a_weight_whose_power_of_two_scale_overflows_is_refused(method):
    # E8M0 scales round up to a power of two: near f32's top, the group's largest code times
    # its scale is infinite (a quantization of 3e38 decoded to inf before this was checked).
    gate, up, down = random_experts(4, 256, 256, dtype=torch.float32)
    gate[1, 3, 5] = 3e38
    w = make_wrapper(e=4, h=256, i=256, method=method)
    with pytest.raises(ValueError, match="beyond f32"):
        w.load_weights_from_tensors(gate, up, down)
    gate[1, 3, 5] = 1e36  # far enough below the top: loads
    w.load_weights_from_tensors(gate, up, down)


def test_gptq_group_scale_beyond_fp16_is_refused():
    # GPTQ_INT4's group scales are fp16: a weight of 1e6 needs a scale above 65504.
    gate, up, down = random_experts(4, 256, 256, dtype=torch.float32)
    down[2, 0, 0] = 1e6
    w = make_wrapper(e=4, h=256, i=256, method="GPTQ_INT4")
    with pytest.raises(ValueError, match="beyond the range"):
        w.load_weights_from_tensors(gate, up, down)
    down[2, 0, 0] = 4e5  # a scale of about 57000: still an fp16 value
    w.load_weights_from_tensors(gate, up, down)
    x = torch.randn(4, 256)
    ids, wt = random_routing(4, 4, 2)
    assert torch.isfinite(w.forward(x, ids, wt)).all()


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL", "MXFP8"])
@pytest.mark.parametrize("where", ["gate", "down"])
def test_decode_of_extreme_weights_matches_the_many_row_path(method, where):
    # The one-to-four-row kernels scale activations by 2^64: a gate weight of 1e20 makes the
    # down projection's inputs about 1e19 and overflowed them, and a down weight of 1e30 its
    # block scale. The results are finite fp32 numbers; decode must give them as prefill does.
    gate, up, down = random_experts(4, 256, 256, dtype=torch.float32)
    if where == "gate":
        gate[:, 0, 0] = 1e20
    else:
        down[:, 0, 0] = 1e30
    w = make_wrapper(e=4, h=256, i=256, method=method)
    w.load_weights_from_tensors(gate, up, down)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    x[:, 0] = x[:, 0].abs() + 0.5
    ids, wt = torch.tensor([[0, 1]] * 32), torch.full((32, 2), 0.5)
    many = w.forward(x, ids, wt)[:2].clone()
    few = w.forward(x[:2], ids[:2], wt[:2])
    assert torch.isfinite(many).all() and torch.isfinite(few).all()
    assert rel_l2(few, many.double()) < 2e-2


def test_select_deferred_experts_checks_its_arguments():
    from kt_kernel.experts_base import BaseMoEWrapper

    split = BaseMoEWrapper.select_deferred_experts
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="one \\[B, k\\] shape"):
        split(ids, torch.rand(2, 2), 1)
    with pytest.raises(ValueError, match="num_experts must be"):
        split(ids, torch.rand(2, 3), 1, num_experts=0)
    with pytest.raises(ValueError, match="pass num_experts"):
        split(torch.tensor([[2**40, 1, 2]]), torch.rand(1, 3), 1)
    # A huge id with num_experts given goes to the spare slot: deferred, never protected.
    imm, dfr = split(torch.tensor([[2**40, 1, 2]]), torch.tensor([[0.9, 0.5, 0.1]]), 1, 8)
    assert imm.tolist() == [[-1, -1, -1]] and dfr.tolist() == [[2**40, 1, 2]]


def test_import_measures_nothing_and_the_kernel_names_report_bad_settings():
    """`import kt_kernel` runs no prefetch calibration (it streams DRAM for a while), so a bad
    `KT_KERNEL_PREFETCH` does not stop the import; the kernel names, looked up on first access,
    run it and refuse the setting by name."""
    code = (
        "import kt_kernel, kt_kernel.kt_kernel_ext as ext; print('imported', flush=True); "
        "print(kt_kernel.__int8_kernel__)"
    )
    r = _run(code, KT_KERNEL_PREFETCH="lots")
    assert r.stdout.split() == ["imported"], (r.stdout, r.stderr)
    assert r.returncode != 0 and "KT_KERNEL_PREFETCH" in r.stderr, r.stderr
    assert "Traceback" in r.stderr and "Segmentation" not in r.stderr
    code = (
        "import kt_kernel, kt_kernel.kt_kernel_ext as ext; from kt_kernel import _kt_core; "
        "i = kt_kernel.cpu_info(); k = i['kernels']; "
        "print(kt_kernel.__int8_kernel__ == ext.__int8_kernel__ == k['AMXINT8'], "
        "kt_kernel.__fp8_kernel__ == k['FP8'], kt_kernel.__int8_kernel__ != '', "
        "_kt_core.physical_cores() == i['physical_cores'] >= 1)"
    )
    r = _run(code)
    assert r.returncode == 0 and r.stdout.split() == ["True"] * 4, (r.stdout, r.stderr)
    import kt_kernel

    with pytest.raises(AttributeError, match="no attribute '__no_such_kernel__'"):
        kt_kernel.__no_such_kernel__  # noqa: B018
