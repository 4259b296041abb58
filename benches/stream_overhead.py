"""Host-thread cost of the CUDA-stream path per layer (submit_forward + sync_forward at one
token), measured with the stand-in driver of tests/fake_cuda (no GPU needed): the stream is
held at a gate while the calls are timed, so only what the calling thread does is measured
(validation, slot lookup, four cuMemcpyAsync and two cuLaunchHostFunc calls, made by the
core as on a GPU). Then the gate opens and the results are checked against the plain path.

    python benches/stream_overhead.py [--layers 8] [--steps 500] [--real-gpu]

With --real-gpu (a CUDA GPU and torch with CUDA) the same calls go to the real driver: the
stream is held by a sleeping kernel (``torch.cuda._sleep``) while the host calls are timed; then
a second loop without the hold times whole decode steps on the stream (inputs and outputs on the
GPU, as SGLang has them) against the blocking alternative (copy to the host, ``forward``, copy
back), all checked against the plain path.

On a GPU machine the driver's own cost of those six calls comes on top of the stand-in's
(which only queues them). The first layer of each step runs with cold caches here: on two
cores the engine's threads have just used the calling thread's core."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "fake_cuda"))
import fake  # noqa: E402
from kt_kernel import KTMoEWrapper, _kt_core, _stream  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--real-gpu", action="store_true", help="time against the real CUDA driver")
    args = p.parse_args()
    if args.real_gpu:
        return real_gpu(args)
    lib = fake.build(Path(tempfile.mkdtemp()))
    if lib is None:
        print("no C compiler: cannot build the stand-in driver")
        return 1
    dev = fake.FakeDevice(lib)
    _stream.DEVICE = dev
    layers, x, ids, wt = make_layers(args)
    stream = lib.fake_stream_create()
    # Warm-up: slots and descriptors are made on first use.
    for w in layers:
        w.submit_forward(x, ids, wt, stream)
        w.sync_forward(x, stream)
    lib.fake_stream_synchronize(stream)
    count = _kt_core.stream_descriptor_count()
    times = []
    for _ in range(args.steps):
        lib.fake_gate(stream)
        for w in layers:
            t0 = time.perf_counter_ns()
            w.submit_forward(x, ids, wt, stream)
            out = w.sync_forward(x, stream)
            times.append(time.perf_counter_ns() - t0)
        lib.fake_gate_open(stream)
        lib.fake_stream_synchronize(stream)
        dev.keep.clear()
    assert torch.equal(out, layers[-1].forward(x, ids, wt))
    assert _kt_core.stream_descriptor_count() == count
    # The blocking path in the same run: the calling thread waits for the compute (on a GPU
    # also for a blocking copy in and one out, not counted here).
    blocking = []
    for _ in range(max(1, args.steps // 5)):
        for w in layers:
            t0 = time.perf_counter_ns()
            w.forward(x, ids, wt)
            blocking.append(time.perf_counter_ns() - t0)
    print(summary(times, len(layers), x.shape[1], count))
    print(
        "The blocking path (CPU tensors, forward waits for the compute): median "
        f"{statistics.median(blocking) / 1e3:.1f} µs per layer over {len(blocking)} calls"
    )
    return 0


def make_layers(args):
    """``args.layers`` BF16 layers of 16 experts, top-8, intermediate 256, and one token."""
    e, k, h, i = 16, 8, args.hidden, 256
    layers = []
    for n in range(args.layers):
        w = KTMoEWrapper(n, e, k, h, i, None, 2, 1, "", 256, method="BF16")
        g = torch.Generator().manual_seed(n)
        gate, up, down = (
            (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
            for shape in ((e, i, h), (e, i, h), (e, h, i))
        )
        w.load_weights_from_tensors(gate, up, down, torch.arange(e))
        layers.append(w)
    x = torch.randn(1, h).to(torch.bfloat16)
    ids = torch.randperm(e)[:k].reshape(1, k).to(torch.int32)
    wt = torch.rand(1, k)
    return layers, x, ids, wt


def summary(times, n, h, count):
    first = statistics.median(times[0::n]) / 1e3
    rest = statistics.median([t for j, t in enumerate(times) if j % n]) / 1e3
    times.sort()
    med = statistics.median(times) / 1e3
    p90 = times[int(0.9 * len(times))] / 1e3
    return (
        f"submit_forward + sync_forward on the stream, 1 token, H={h}: median {med:.1f} µs, "
        f"p90 {p90:.1f} µs per layer over {len(times)} calls (first layer of a step {first:.1f}, "
        f"the others {rest:.1f}); descriptors {count} (no growth)."
    )


def real_gpu(args) -> int:
    if not torch.cuda.is_available():
        print("--real-gpu: torch sees no CUDA GPU")
        return 1
    layers, x, ids, wt = make_layers(args)
    want = layers[-1].forward(x, ids, wt)
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    xd, idsd, wtd = x.cuda(), ids.cuda(), wt.cuda()

    def step():
        for w in layers:
            w.submit_forward(xd, idsd, wtd, handle)
            out = w.sync_forward(xd, handle)
        return out

    with torch.cuda.stream(stream):
        step()  # slots and descriptors are made on first use
    stream.synchronize()
    count = _kt_core.stream_descriptor_count()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(args.steps):
            torch.cuda._sleep(20_000_000)  # holds the stream (10-60 ms) while we time
            for w in layers:
                t0 = time.perf_counter_ns()
                w.submit_forward(xd, idsd, wtd, handle)
                out = w.sync_forward(xd, handle)
                times.append(time.perf_counter_ns() - t0)
            stream.synchronize()
    assert torch.equal(out.cpu(), want)
    assert _kt_core.stream_descriptor_count() == count
    # Whole steps, no hold: the latency a decode step sees per layer.
    on_stream, blocking = [], []
    for _ in range(max(1, args.steps // 2)):
        t0 = time.perf_counter_ns()
        with torch.cuda.stream(stream):
            out = step()
        stream.synchronize()
        on_stream.append((time.perf_counter_ns() - t0) / len(layers))
        t0 = time.perf_counter_ns()
        for w in layers:
            back = w.forward(xd.cpu(), idsd.cpu(), wtd.cpu()).cuda()
        torch.cuda.synchronize()
        blocking.append((time.perf_counter_ns() - t0) / len(layers))
    assert torch.equal(out.cpu(), want) and torch.equal(back.cpu(), want)
    print("REAL GPU:", torch.cuda.get_device_name())
    print(summary(times, len(layers), x.shape[1], count))
    print(
        "whole decode steps, per layer: on the stream "
        f"{statistics.median(on_stream) / 1e3:.1f} µs, blocking copy-forward-copy "
        f"{statistics.median(blocking) / 1e3:.1f} µs (medians of "
        f"{len(on_stream)} steps of {len(layers)} layers)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
