"""The CUDA-stream path on a real GPU (skipped without one): SGLang's call sequence with CUDA
tensors on a side stream, results equal to the CPU path, and a captured ``torch.cuda.CUDAGraph``
replayed with new inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import make_wrapper, random_experts, random_routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, K, H, I = 8, 2, 256, 512  # noqa: E741 (the MoE shape letters)


def _layer(layer_idx, **kw):
    w = make_wrapper(layer_idx=layer_idx, e=E, k=K, h=H, i=I, chunk=256, **kw)
    w.load_weights_from_tensors(*random_experts(E, H, I, seed=layer_idx), torch.arange(E))
    return w


def _inputs(tokens, seed):
    ids, wt = random_routing(tokens, E, K, seed=seed, id_dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    return x, ids, wt


def test_stream_results_equal_the_cpu_path():
    w = _layer(40)
    stream = torch.cuda.Stream()
    for tokens in (1, 4, 33):
        x, ids, wt = _inputs(tokens, tokens)
        want = w.forward(x, ids, wt)
        with torch.cuda.stream(stream):
            xd, idsd, wtd = x.cuda(), ids.cuda(), wt.cuda()
            w.submit_forward(xd, idsd, wtd, stream.cuda_stream)
            out = w.sync_forward(xd, stream.cuda_stream)
        stream.synchronize()
        assert out.is_cuda and torch.equal(out.cpu(), want)


def test_deferred_experts_on_the_gpu_stream_equal_the_cpu_path():
    layers = [_layer(50 + n, max_deferred_experts_per_token=1) for n in range(2)]
    x, ids, wt = _inputs(3, 7)
    want = []
    for layer in layers:
        layer.submit_forward(x, ids, wt)
        want.append(layer.sync_forward(x).clone())
    stream = torch.cuda.Stream()
    got = []
    with torch.cuda.stream(stream):
        xd, idsd, wtd = x.cuda(), ids.cuda(), wt.cuda()
        for layer in layers:
            layer.submit_forward(xd, idsd, wtd, stream.cuda_stream)
            got.append(layer.sync_forward(xd, stream.cuda_stream).clone())
    stream.synchronize()
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b.cpu())


def test_a_captured_cuda_graph_replays_with_new_inputs():
    w = _layer(60)
    type(w).set_capture_batch_sizes([4])
    try:
        x, ids, wt = _inputs(4, 11)
        xd, idsd, wtd = x.cuda(), ids.cuda(), wt.cuda()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # warm-up outside capture makes the slot
            w.submit_forward(xd, idsd, wtd, stream.cuda_stream)
            w.sync_forward(xd, stream.cuda_stream)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            w.submit_forward(xd, idsd, wtd, stream.cuda_stream)
            out = w.sync_forward(xd, stream.cuda_stream)
        for seed in (12, 13, 14):
            nx, nids, nwt = _inputs(4, seed)
            xd.copy_(nx), idsd.copy_(nids), wtd.copy_(nwt)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), w.forward(nx, nids, nwt))
    finally:
        type(w).set_capture_batch_sizes([])
