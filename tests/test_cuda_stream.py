"""The CUDA-stream path without a GPU: a stand-in driver library (``fake_cuda/fake_cuda.c``,
built here) exports the ``cuLaunchHostFunc`` kt-kernel opens and runs each "stream" in order
on its own thread, with memory copies, gates, markers and graph capture/replay. The wrapper's
device copies go to that stream (``_stream.DEVICE``), so the whole SGLang sequence runs:
copies in, CPU experts started by a host function, a waiting host function, copy out."""

from __future__ import annotations

import ctypes
import resource
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_wrapper, random_experts, random_routing
from kt_kernel import _kt_core, _stream
from kt_kernel.experts_base import BaseMoEWrapper

sys.path.insert(0, str(Path(__file__).parent / "fake_cuda"))
import fake  # noqa: E402


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = fake.build(tmp_path_factory.mktemp("fake_cuda"))
    if lib is None:
        pytest.skip("no C compiler for the stand-in CUDA driver")
    return lib


@pytest.fixture
def device(lib, monkeypatch):
    dev = fake.FakeDevice(lib)
    monkeypatch.setattr(_stream, "DEVICE", dev)
    return dev


def _layer(layer_idx=0, e=8, k=2, h=256, i=512, **kw):
    w = make_wrapper(layer_idx=layer_idx, e=e, k=k, h=h, i=i, chunk=256, **kw)
    w.load_weights_from_tensors(*random_experts(e, h, i, seed=layer_idx), torch.arange(e))
    return w


def _stream_task(w, x, ids, wt, out) -> int:
    """The low-level stream task of layer ``w`` over these bf16 / int32 / f32 tensors."""
    return w.moe.stream_task(
        x.shape[0], x.data_ptr(), "bfloat16", ids.data_ptr(), "int32", wt.data_ptr(),
        out.data_ptr(), "bfloat16", mask_ptr=w.gpu_experts_mask.data_ptr(),
    )  # fmt: skip


def _inputs(tokens, e=8, k=2, h=256, seed=1):
    ids, wt = random_routing(tokens, e, k, seed=seed, id_dtype=torch.int32)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return x, ids, wt


def test_submit_returns_before_the_stream_runs_and_the_order_holds(lib, device):
    w = _layer()
    x, ids, wt = _inputs(64)
    plain = w.forward(x, ids, wt)
    stream = lib.fake_stream_create()
    lib.fake_gate(stream)  # the stream stops here until the gate opens
    seen = []
    probe = fake.HOST_FN(lambda _: seen.append(w.cpu_infer.engine.pending()))
    w.submit_forward(x, ids, wt, stream)
    lib.cuLaunchHostFunc(stream, probe, None)  # after the start, before the wait
    out = w.sync_forward(x, stream)
    lib.cuLaunchHostFunc(stream, probe, None)  # after the wait, before the copy back
    # Both calls returned while the stream had run nothing.
    assert lib.fake_host_calls(stream) == 0 and not seen
    assert out.abs().sum() == 0
    lib.fake_gate_open(stream)
    lib.fake_stream_synchronize(stream)
    # Copy in before compute (the staging buffer started as zeros), the wait before the copy
    # back: the result is the plain path's, bit for bit, and nothing was pending after the wait.
    assert torch.equal(out, plain)
    assert seen[1] == 0, seen
    assert lib.fake_host_calls(stream) == 4  # start, probe, wait, probe


def test_a_captured_graph_replays_with_the_same_descriptors(lib, device):
    w = _layer(layer_idx=1)
    BaseMoEWrapper.set_capture_batch_sizes([4])
    try:
        x, ids, wt = _inputs(4, seed=5)
        x, ids, wt = x.clone(), ids.clone(), wt.clone()  # the "device" inputs graphs read
        stream = lib.fake_stream_create()
        graphs, outs = [], []
        for _ in range(2):
            lib.fake_capture_begin(stream)
            w.submit_forward(x, ids, wt, stream)
            outs.append(w.sync_forward(x, stream))
            graphs.append(lib.fake_capture_end(stream))
        assert outs[0] is outs[1]  # one slot per captured batch size
        args = []
        for g in graphs:
            buf = (ctypes.c_size_t * 8)()
            assert lib.fake_graph_host_args(g, buf, 8) == 2  # start and wait
            args.append(list(buf[:2]))
        assert args[0] == args[1], "the same arguments must give the same descriptors"
        count = _kt_core.stream_descriptor_count()
        for step in range(3):
            new = _inputs(4, seed=10 + step)
            x.copy_(new[0]), ids.copy_(new[1]), wt.copy_(new[2])
            lib.fake_graph_launch(graphs[step % 2], stream)
            lib.fake_stream_synchronize(stream)
            assert torch.equal(outs[0], w.forward(*new))
        assert _kt_core.stream_descriptor_count() == count
    finally:
        BaseMoEWrapper.set_capture_batch_sizes([])


def test_ten_thousand_steps_allocate_no_descriptors_and_no_memory(lib, device):
    w = _layer(layer_idx=2, h=64, i=64)
    x, ids, wt = _inputs(1, h=64, seed=7)
    stream = lib.fake_stream_create()

    def steps(n):
        for _ in range(n):
            w.submit_forward(x, ids, wt, stream)
            out = w.sync_forward(x, stream)
        lib.fake_stream_synchronize(stream)
        device.keep.clear()
        return out

    steps(200)
    count = _kt_core.stream_descriptor_count()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = steps(10_000)
    assert _kt_core.stream_descriptor_count() == count
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown_kib < 4096, grown_kib
    assert torch.equal(out, w.forward(x, ids, wt))


def test_new_batch_sizes_share_one_slot_released_after_the_stream_passes(lib, device):
    w = _layer(layer_idx=3, h=64, i=64)
    stream = lib.fake_stream_create()
    for t in (1, 2, 3, 2, 5):
        x, ids, wt = _inputs(t, h=64, seed=t)
        w.submit_forward(x, ids, wt, stream)
        out = w.sync_forward(x, stream)
        lib.fake_stream_synchronize(stream)
        assert torch.equal(out, w.forward(x, ids, wt))
    state = w._stream_state
    assert len(state.slots) == 1 and len(state.retired) <= 1


def test_deferred_experts_on_the_stream_equal_the_plain_path(lib, device):
    layers = [_layer(layer_idx=10 + n, max_deferred_experts_per_token=1) for n in range(2)]
    batches = [_inputs(3, seed=20 + s) for s in range(2)]

    def run(stream):
        outs = []
        for x, ids, wt in batches:
            for layer in layers:
                layer.submit_forward(x, ids, wt, stream)
                out = layer.sync_forward(x, stream)
                if stream is not None:
                    lib.fake_stream_synchronize(stream)
                outs.append(out.clone())
        return outs

    plain = run(None)
    BaseMoEWrapper.clear_buffer_cache()
    streamed = run(lib.fake_stream_create())
    for a, b in zip(plain, streamed, strict=True):
        assert torch.equal(a, b)


def test_an_error_on_the_stream_is_raised_by_the_next_call(lib, device):
    w = _layer(layer_idx=4, h=64, i=64)
    x, ids, wt = _inputs(2, h=64)
    stream = lib.fake_stream_create()
    w.submit_forward(x, ids, wt, stream)
    w.sync_forward(x, stream)
    lib.fake_stream_synchronize(stream)
    (slot,) = w._stream_state.slots.values()
    slot.bsz.fill_(0)  # the task reads the batch size when it runs: now an invalid one
    lib.fake_gate(stream)  # held until both calls returned: the error happens later
    w.submit_forward(x, ids, wt, stream)
    w.sync_forward(x, stream)
    lib.fake_gate_open(stream)
    lib.fake_stream_synchronize(stream)
    with pytest.raises(RuntimeError, match="batch-size cell holds 0"):
        w.submit_forward(x, ids, wt, stream)
    # Recovered: the next forward works.
    slot.bsz.fill_(2)
    w.submit_forward(x, ids, wt, stream)
    out = w.sync_forward(x, stream)
    lib.fake_stream_synchronize(stream)
    assert torch.equal(out, w.forward(x, ids, wt))


def test_force_sync_submit_takes_the_plain_path(lib, device, monkeypatch):
    monkeypatch.setenv("KT_FORCE_SYNC_SUBMIT", "1")
    w = _layer(layer_idx=5, h=64, i=64)
    x, ids, wt = _inputs(2, h=64)
    stream = lib.fake_stream_create()
    w.submit_forward(x, ids, wt, stream)
    out = w.sync_forward(x, stream)
    assert lib.fake_host_calls(stream) == 0
    assert torch.equal(out, w.forward(x, ids, wt))


def test_the_low_level_engine_orders_a_task_on_a_stream(lib):
    w = _layer(layer_idx=6, h=64, i=64)
    x, ids, wt = _inputs(3, h=64)
    out = torch.zeros(3, 64, dtype=torch.bfloat16)
    task = _stream_task(w, x, ids, wt, out)
    assert task == _stream_task(w, x, ids, wt, out)
    cpu_infer = w.cpu_infer
    stream = lib.fake_stream_create()
    lib.fake_gate(stream)
    cpu_infer.submit_with_cuda_stream(stream, task)
    cpu_infer.sync_with_cuda_stream(stream, 0)
    assert out.abs().sum() == 0
    lib.fake_gate_open(stream)
    lib.fake_stream_synchronize(stream)
    assert torch.equal(out, w.forward(x, ids, wt))
    out.zero_()
    cpu_infer.submit(task)
    cpu_infer.sync()
    assert torch.equal(out, w.forward(x, ids, wt))
    with pytest.raises(ValueError, match="not a task"):
        cpu_infer.submit(12345)


def test_bad_stream_inputs_are_refused_clearly(lib, device):
    w = _layer(layer_idx=7, h=64, i=64)
    x, ids, wt = _inputs(2, h=64)
    stream = lib.fake_stream_create()
    with pytest.raises(ValueError, match="topk_ids is on meta"):
        w.submit_forward(x, ids.to("meta"), wt, stream)
    out = torch.zeros(2, 64, dtype=torch.bfloat16)
    args = (2, x.data_ptr(), "bfloat16", ids.data_ptr(), "int32", wt.data_ptr(), out.data_ptr())
    with pytest.raises(ValueError, match="not aligned for an int32"):
        w.moe.stream_task(*args, "bfloat16", bsz_ptr=out.data_ptr() + 1)
    with pytest.raises(RuntimeError, match="dlopen failed"):
        _kt_core.use_cuda_driver("/nonexistent/libcuda.so.1")
    # The driver in use is still the stand-in: the stream path goes on working.
    w.submit_forward(x, ids, wt, stream)
    got = w.sync_forward(x, stream)
    lib.fake_stream_synchronize(stream)
    assert torch.equal(got, w.forward(x, ids, wt))


def test_a_stream_of_another_device_is_driven_in_its_own_context(lib, device):
    # The stand-in refuses copies and host functions on a stream whose context is not current
    # (as CUDA does); the core makes the stream's context current around its calls.
    w = _layer(layer_idx=8, h=64, i=64)
    x, ids, wt = _inputs(3, h=64, seed=3)
    stream = lib.fake_stream_create()
    lib.fake_stream_set_device(stream, 1)
    pushes = lib.fake_ctx_pushes()
    w.submit_forward(x, ids, wt, stream)
    out = w.sync_forward(x, stream)
    lib.fake_stream_synchronize(stream)
    assert torch.equal(out, w.forward(x, ids, wt))
    assert lib.fake_ctx_pushes() == pushes + 2  # one for the submit, one for the sync
    # On a stream of the current device no context is pushed.
    same = lib.fake_stream_create()
    w.submit_forward(x, ids, wt, same)
    w.sync_forward(x, same)
    lib.fake_stream_synchronize(same)
    assert lib.fake_ctx_pushes() == pushes + 2


def test_inputs_needing_conversion_are_converted_on_the_stream(lib, device):
    w = _layer(layer_idx=9, h=64, i=64)
    x, ids, wt = _inputs(4, h=64, seed=4)
    stream = lib.fake_stream_create()
    # float64 activations, int16 ids, bf16 weights, a non-contiguous view of the activations.
    wide = torch.cat([x.double(), x.double()], dim=1)[:, :64]
    assert not wide.is_contiguous()
    w.submit_forward(wide, ids.to(torch.int16), wt.to(torch.bfloat16), stream)
    out = w.sync_forward(wide, stream)
    lib.fake_stream_synchronize(stream)
    plain = w.forward(wide.contiguous(), ids.to(torch.int16), wt.to(torch.bfloat16))
    assert out.dtype == plain.dtype and torch.equal(out, plain)


def test_stream_copies_with_a_null_address_are_refused(lib):
    w = _layer(layer_idx=11, h=64, i=64)
    x, ids, wt = _inputs(1, h=64)
    out = torch.zeros(1, 64, dtype=torch.bfloat16)
    task = _stream_task(w, x, ids, wt, out)
    engine = w.cpu_infer.engine
    stream = lib.fake_stream_create()
    with pytest.raises(ValueError, match="null address"):
        engine.start_on_stream(stream, task, [(0, x.data_ptr(), 128)])
    with pytest.raises(ValueError, match="null address"):
        engine.sync_on_stream(stream, 0, [(out.data_ptr(), 0, 128)])
    assert lib.fake_host_calls(stream) == 0
