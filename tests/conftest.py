"""Shared helpers: random experts, a float64 reference MoE, wrapper construction."""

from __future__ import annotations

import zlib

import kt_kernel
import pytest
import torch

THREADS = 2


@pytest.fixture(autouse=True)
def _seed_torch_per_test(request):
    """Seed torch's global generator from the test's own id: a test's unseeded draws (its
    random inputs) then do not depend on which tests ran before it in the process. They did:
    adding an unrelated test once moved an AMXINT4 error draw past its bound."""
    # The id from the file on: the same seed whichever folder pytest runs from.
    torch.manual_seed(zlib.crc32(request.node.nodeid.split("/")[-1].encode()))


def reference_moe(x, ids, weights, gate, up, down, mask=None, limit=0.0, alpha=0.0):
    """float64 MoE over the given experts; ids < 0, >= E and masked experts are skipped."""
    e_count = gate.shape[0]
    xd = x.reshape(-1, gate.shape[2]).double()
    out = torch.zeros_like(xd)
    for t in range(xd.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e < 0 or e >= e_count or (mask is not None and bool(mask[e])):
                continue
            g = gate[e].double() @ xd[t]
            u = up[e].double() @ xd[t]
            if limit > 0:
                g = g.clamp(max=limit)
                u = u.clamp(-limit, limit)
            if alpha > 0:
                a = g * torch.sigmoid(alpha * g) * (u + 1)
            else:
                a = torch.nn.functional.silu(g) * u
            out[t] += float(weights[t, s]) * (down[e].double() @ a)
    return out


def rel_l2(out, ref) -> float:
    out = out.reshape(ref.shape).double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def random_experts(e, h, i, dtype=torch.bfloat16, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    return mk(e, i, h), mk(e, i, h), mk(e, h, i)


def random_routing(tokens, e, k, seed=1, id_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(id_dtype)
    w = torch.rand(tokens, k, generator=g) + 0.05
    return ids, w


def make_wrapper(layer_idx=0, e=8, k=2, h=64, i=64, chunk=64, **kw):
    args = dict(
        layer_idx=layer_idx,
        num_experts=e,
        num_experts_per_tok=k,
        hidden_size=h,
        moe_intermediate_size=i,
        gpu_experts_mask=None,
        cpuinfer_threads=THREADS,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=chunk,
        method="BF16",
    )
    args.update(kw)
    return kt_kernel.KTMoEWrapper(**args)


@pytest.fixture
def small_layer():
    """A loaded 8-expert layer and its weights."""
    e, k, h, i = 8, 2, 64, 96
    gate, up, down = random_experts(e, h, i)
    w = make_wrapper(e=e, k=k, h=h, i=i)
    w.load_weights_from_tensors(gate, up, down, torch.arange(e))
    return w, (gate, up, down)
