"""Numerics and semantics of forward against a float64 reference on random data."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_wrapper, random_experts, random_routing, reference_moe, rel_l2

# bf16 output rounding dominates; fp32 output shows the kernels' own accuracy.
# Prefill-sized experts may take the bf16 dot path (activations rounded to bf16): ~3e-3.
TOL = {torch.bfloat16: 8e-3, torch.float16: 5e-3, torch.float32: 5e-3}


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_matches_float64_reference(small_layer, x_dtype, id_dtype, tokens):
    w, (gate, up, down) = small_layer
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(x_dtype)
    ids, wt = random_routing(tokens, 8, 2, seed=tokens, id_dtype=id_dtype)
    out = w.forward(x, ids, wt, None)
    assert out.dtype == x_dtype and out.shape == x.shape
    ref = reference_moe(x, ids, wt, gate, up, down)
    assert rel_l2(out, ref) < TOL[x_dtype]


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
def test_weights_in_other_float_types(weight_dtype):
    gate, up, down = random_experts(6, 64, 64, dtype=weight_dtype, seed=4)
    w = make_wrapper(e=6, k=2)
    w.load_weights_from_tensors(gate, up, down, None)
    x = torch.randn(5, 64)
    ids, wt = random_routing(5, 6, 2)
    out = w.forward(x, ids, wt, None)
    # The packed weights are bf16: compare with the reference on bf16-rounded weights.
    ref = reference_moe(x, ids, wt, *(t.to(torch.bfloat16) for t in (gate, up, down)))
    assert rel_l2(out, ref) < 5e-3


def test_leading_dims_are_flattened(small_layer):
    w, (gate, up, down) = small_layer
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    ids, wt = random_routing(6, 8, 2)
    out = w.forward(x, ids, wt, None)
    assert out.shape == (2, 3, 64)
    assert rel_l2(out.reshape(6, 64), reference_moe(x, ids, wt, gate, up, down)) < 8e-3


def test_skips_invalid_ids_and_gpu_experts_read_live(small_layer):
    w, (gate, up, down) = small_layer
    x = torch.randn(4, 64, dtype=torch.float32)
    ids = torch.tensor([[0, -1], [7, 8], [3, 100], [-1, -1]])
    wt = torch.rand(4, 2)
    out = w.forward(x, ids, wt, None)
    assert rel_l2(out, reference_moe(x, ids, wt, gate, up, down)) < 5e-3
    assert torch.all(out[3] == 0)
    # SGLang updates the mask in place between forwards; the next call must honour it.
    w.gpu_experts_mask.copy_(torch.tensor([True, False, False, True, False, False, False, True]))
    out2 = w.forward(x, ids, wt, None)
    ref2 = reference_moe(x, ids, wt, gate, up, down, mask=w.gpu_experts_mask)
    assert rel_l2(out2, ref2) < 5e-3
    assert torch.all(out2[0] == 0) and torch.all(out2[1] == 0)
    w.gpu_experts_mask.zero_()


def test_gpu_experts_mask_argument_and_num_gpu_experts():
    gate, up, down = random_experts(8, 64, 64, seed=2)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[1, 5]] = True
    x = torch.randn(6, 64)
    ids, wt = random_routing(6, 8, 3)
    for kwargs, ref_mask in (
        ({"gpu_experts_mask": mask}, mask),
        ({"num_gpu_experts": 4}, torch.arange(8) < 4),
    ):
        w = make_wrapper(e=8, k=3, **kwargs)
        w.load_weights_from_tensors(gate, up, down)
        out = w.forward(x, ids, wt, None)
        assert rel_l2(out, reference_moe(x, ids, wt, gate, up, down, mask=ref_mask)) < 5e-3


def test_physical_to_logical_map_on_tensor_path():
    gate, up, down = random_experts(8, 64, 64, seed=3)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    w = make_wrapper(e=8, k=2)
    w.load_weights_from_tensors(gate, up, down, perm)
    x = torch.randn(7, 64)
    ids, wt = random_routing(7, 8, 2)
    out = w.forward(x, ids, wt, None)
    # Slot p holds logical expert perm[p].
    ref = reference_moe(x, ids, wt, gate[perm], up[perm], down[perm])
    assert rel_l2(out, ref) < 5e-3


def test_nan_in_one_token_does_not_touch_others(small_layer):
    w, _ = small_layer
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    x[7, 3] = float("nan")
    ids = torch.zeros(40, 2, dtype=torch.int64)  # every token shares experts 0 and 1
    ids[:, 1] = 1
    wt = torch.rand(40, 2)
    out = w.forward(x, ids, wt, None)
    assert torch.isnan(out[7]).all()
    others = torch.cat([out[:7], out[8:]])
    assert torch.isfinite(others).all()


def test_swiglu_limit_and_alpha():
    gate, up, down = random_experts(4, 64, 64, seed=5, scale=0.3)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    ids, wt = random_routing(5, 4, 2)
    for limit, alpha in ((0.5, 0.0), (0.0, 1.702), (0.7, 1.702)):
        w = make_wrapper(e=4, k=2, swiglu_limit=limit, swiglu_alpha=alpha)
        w.load_weights_from_tensors(gate, up, down)
        out = w.forward(x, ids, wt, None)
        ref = reference_moe(x, ids, wt, gate, up, down, limit=limit, alpha=alpha)
        # Activations are rounded to bf16 on this path: with the clamp the output is small and
        # its relative error runs up to 5.3e-3 over random inputs (median 4e-3); a wrong clamp
        # or activation is off by far more.
        assert rel_l2(out, ref) < 8e-3, (limit, alpha)


def test_deferred_experts_sum_matches_undeferred():
    """With d deferred experts, layer L's deferred part is added to layer L+1's output: the sum
    of both layers' outputs equals the sum without deferral (the last layer defers nothing, as
    SGLang configures it)."""
    e, k = 8, 4
    gate, up, down = random_experts(e, 64, 64, seed=6)
    x = torch.randn(5, 64)
    ids, wt = random_routing(5, e, k, seed=9)
    plain = [make_wrapper(layer_idx=10 + j, e=e, k=k) for j in range(2)]
    deferred = [
        make_wrapper(layer_idx=20, e=e, k=k, max_deferred_experts_per_token=2),
        make_wrapper(layer_idx=21, e=e, k=k, max_deferred_experts_per_token=0),
    ]
    for w in plain + deferred:
        w.load_weights_from_tensors(gate, up, down)
    p0, p1 = (w.forward(x, ids, wt, None) for w in plain)
    d0 = deferred[0].forward(x, ids, wt, None)
    d1 = deferred[1].forward(x, ids, wt, None)
    assert rel_l2(d0, p0.double()) > 1e-2  # something was really deferred
    assert rel_l2(d0 + d1, (p0 + p1).double()) < 5e-3
    imm, dfr = deferred[0].select_deferred_experts(ids, wt, k - 2)
    assert torch.all((imm == -1) | (dfr == -1))
    assert torch.all(torch.where(imm >= 0, imm, dfr) == ids)


def test_submit_then_sync_and_captured_buffers_do_not_move(small_layer):
    from kt_kernel import KTMoEWrapper

    w, (gate, up, down) = small_layer
    KTMoEWrapper.set_capture_batch_sizes([4])
    try:
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        ids, wt = random_routing(4, 8, 2)
        ptrs = set()
        for _ in range(20):
            w.submit_forward(x, ids, wt, 0)
            out = w.sync_forward(x, 0)
            ptrs.add(out.data_ptr())
        w.forward(torch.randn(3, 64, dtype=torch.bfloat16), *random_routing(3, 8, 2), None)
        w.submit_forward(x, ids, wt, None)
        ptrs.add(w.sync_forward(x, None).data_ptr())
        assert len(ptrs) == 1
        assert rel_l2(out, reference_moe(x, ids, wt, gate, up, down)) < 8e-3
        KTMoEWrapper.clear_buffer_cache()
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])


def test_forward_with_other_work_queued_keeps_order_and_results():
    # forward() runs on the calling thread only when the engine is idle; with a submitted,
    # not yet synced forward (this layer's or another's) it queues behind it.
    layers = []
    for j in range(2):
        weights = random_experts(8, 64, 64, seed=50 + j)
        w = make_wrapper(layer_idx=60 + 2 * j, e=8, k=2)
        w.load_weights_from_tensors(*weights)
        layers.append((w, weights))
    (a, wa), (b, wb) = layers
    xs = [torch.randn(5, 64) for _ in range(3)]
    routes = [random_routing(5, 8, 2, seed=70 + i) for i in range(3)]
    a.submit_forward(xs[0], *routes[0])
    out_b = b.forward(xs[1], *routes[1])  # another layer's forward is pending
    a.submit_forward(xs[2], *routes[2])
    # This layer has two pending: forward = submit + sync, and sync returns the oldest.
    outs_a = [a.forward(xs[1], *routes[1]), a.sync_forward(xs[0]), a.sync_forward(xs[0])]
    assert rel_l2(out_b, reference_moe(xs[1], *routes[1], *wb)) < 5e-3
    for out, i in zip(outs_a, [0, 2, 1], strict=True):
        assert rel_l2(out, reference_moe(xs[i], *routes[i], *wa)) < 5e-3


def test_several_wrappers_from_several_threads():
    layers = []
    for j in range(3):
        weights = random_experts(8, 64, 64, seed=30 + j)
        w = make_wrapper(layer_idx=40 + j, e=8, k=2)
        w.load_weights_from_tensors(*weights)
        layers.append((w, weights))
    errors = []

    def drive(w, weights, seed):
        try:
            for it in range(15):
                x = torch.randn(3 + it % 4, 64)
                ids, wt = random_routing(x.shape[0], 8, 2, seed=seed + it)
                out = w.forward(x, ids, wt, None)
                err = rel_l2(out, reference_moe(x, ids, wt, *weights))
                if err > 5e-3:
                    errors.append(err)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [
        threading.Thread(target=drive, args=(w, ws, 100 * j)) for j, (w, ws) in enumerate(layers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("chunk", [1, 16, -1])
def test_any_chunked_prefill_size(chunk):
    gate, up, down = random_experts(8, 64, 64, seed=8)
    w = make_wrapper(e=8, k=2, chunk=chunk)
    w.load_weights_from_tensors(gate, up, down)
    tokens = 1 if chunk == 1 else 16
    x = torch.randn(tokens, 64)
    ids, wt = random_routing(tokens, 8, 2)
    assert rel_l2(w.forward(x, ids, wt, None), reference_moe(x, ids, wt, gate, up, down)) < 5e-3


def test_zero_tokens_give_an_empty_output(small_layer):
    # The original fails here ("not enough values to unpack").
    w, _ = small_layer
    out = w.forward(
        torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), None
    )
    assert out.shape == (0, 64)


def test_an_output_is_recycled_only_once_nothing_else_can_reach_it(small_layer):
    import weakref

    import numpy as np

    w, _ = small_layer
    inputs = [
        (torch.randn(2, 64, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16),)
        + random_routing(2, 8, 2, seed=s)
        for s in range(8)
    ]

    def fresh(n):  # the output of input n, computed into a buffer nobody holds afterwards
        return w.forward(*inputs[n], None).clone()

    expected = [fresh(n) for n in range(8)]
    out = w.forward(*inputs[0], None)
    address, first = out.data_ptr(), weakref.ref(out)
    del out
    out = w.forward(*inputs[1], None)
    assert first() is out, "a buffer nobody holds is written again"
    assert torch.equal(out, expected[1])
    # Every way of keeping the buffer reachable keeps it from being written again.
    holders = {
        "the tensor": lambda t: t,
        "a view": lambda t: t.view(-1),
        "a detached alias": lambda t: t.detach(),
        "a numpy array": lambda t: t.view(torch.int16).numpy(),
        "a DLPack capsule": lambda t: torch.utils.dlpack.to_dlpack(t),
    }
    for n, (name, hold) in enumerate(holders.items(), start=2):
        held = hold(out)
        del out
        out = w.forward(*inputs[n], None)
        assert out.data_ptr() != address, name
        assert torch.equal(out, expected[n]), name
        if isinstance(held, torch.Tensor):
            assert torch.equal(held.reshape(2, 64).view(torch.bfloat16), expected[n - 1]), name
        elif isinstance(held, np.ndarray):
            assert torch.equal(torch.from_numpy(held).view(torch.bfloat16), expected[n - 1]), name
        address = out.data_ptr()
        del held


def _unusual_inputs(x, ids, wt):
    """Inputs the kernels cannot take as they are, each with what the general path makes of it."""
    return {
        "strided x": (torch.cat([x, x], 1)[:, ::2], ids, wt),
        "negated view of x": ((-x)._neg_view(), ids, wt),
        "3-D x": (x.reshape(1, *x.shape), ids, wt),
        "float64 x": (x.double(), ids, wt),
        "int16 ids": (x, ids.to(torch.int16), wt),
        "bf16 weights": (x, ids, wt.bfloat16()),
        "transposed ids": (x, ids.t().contiguous().t(), wt),
        "a Parameter as x": (torch.nn.Parameter(x, requires_grad=False), ids, wt),
    }


def test_ready_inputs_skip_conversion_and_others_are_converted(small_layer):
    """forward's decode path takes inputs that are already in kernel form as they are; any
    other input goes through the general checks and conversions, to the same numbers."""
    w, (gate, up, down) = small_layer
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids, wt = random_routing(3, 8, 2, seed=5)
    assert w._kernel_ready(x, ids, wt)
    assert w._kernel_ready(x, ids.int(), wt) and w._kernel_ready(x.float(), ids, wt)
    plain = w.forward(x, ids, wt, None).clone()
    assert rel_l2(plain, reference_moe(x, ids, wt, gate, up, down)) < TOL[torch.bfloat16]
    for name, (ux, uids, uwt) in _unusual_inputs(x, ids, wt).items():
        assert not w._kernel_ready(ux, uids, uwt), name
        out = w.forward(ux, uids, uwt, None)
        ref = reference_moe(ux.resolve_neg(), uids, uwt, gate, up, down)
        assert out.shape == ux.shape, name
        tol = 5e-3 if ux.dtype == torch.float64 else TOL[torch.bfloat16]
        assert rel_l2(out.reshape(3, 64), ref) < tol, name
    # Inputs without ordinary storage are not ready either: the general checks refuse them.
    refused = {
        "zero tensor x": torch._efficientzerotensor(x.shape, dtype=x.dtype),
        "sparse x": x.float().to_sparse(),
    }
    for name, ux in refused.items():
        assert not w._kernel_ready(ux, ids, wt), name
        with pytest.raises((TypeError, ValueError), match="hidden_states"):
            w.forward(ux, ids, wt, None)
    # A mask swapped for one the kernels cannot read sends the call to the general checks.
    good_mask = w.gpu_experts_mask
    try:
        w.gpu_experts_mask = torch.zeros(5, dtype=torch.bool)
        assert not w._kernel_ready(x, ids, wt)
        with pytest.raises(ValueError, match="gpu_experts_mask"):
            w.forward(x, ids, wt, None)
    finally:
        w.gpu_experts_mask = good_mask
