"""Number compatibility with the original kt-kernel 0.7.2 on its own recorded inputs/outputs
(../shared/fixtures, written by the original; see its README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_wrapper
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")


def _io(name):
    with safe_open(str(FIXTURES / "native" / name), "pt") as f:
        meta = json.loads(f.metadata()["kt_fixture"])
        return meta, {k: f.get_tensor(k) for k in f.keys()}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_bf16_checkpoint_matches_original_outputs():
    meta, io = _io("io-bf16-tp1.safetensors")
    w = make_wrapper(
        layer_idx=1,
        e=4,
        k=2,
        h=128,
        i=256,
        chunk=64,
        weight_path=str(FIXTURES / "native" / "bf16"),
    )
    w.load_weights(torch.arange(4))
    for t in (1, 5, 16):
        x, ids, wt = io[f"T{t}.x"], io[f"T{t}.topk_ids"], io[f"T{t}.topk_weights"]
        out = w.forward(x, ids, wt, None)
        ours_vs_ref = _rel(out, io[f"T{t}.ref"])
        orig_vs_ref = _rel(io[f"T{t}.out"], io[f"T{t}.ref"])
        # No worse than the original against the float64 reference, and close to its output.
        assert ours_vs_ref <= orig_vs_ref + 1e-4, (t, ours_vs_ref, orig_vs_ref)
        assert _rel(out, io[f"T{t}.out"]) < 1e-2


def test_bf16_two_subpools_match_original_outputs():
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_fixtures as tf
from conftest import make_wrapper
meta, io = tf._io("io-bf16-tp2.safetensors")
w = make_wrapper(layer_idx=1, e=4, k=2, h=128, i=256, chunk=64, threadpool_count=2,
                 weight_path=str(tf.FIXTURES / "native" / "bf16"))
w.load_weights(torch.arange(4))
assert w.cpu_infer.engine.parts == 2
for t in (1, 5, 16):
    out = w.forward(io[f"T{{t}}.x"], io[f"T{{t}}.topk_ids"], io[f"T{{t}}.topk_weights"], None)
    assert tf._rel(out, io[f"T{{t}}.ref"]) <= tf._rel(io[f"T{{t}}.out"], io[f"T{{t}}.ref"]) + 1e-4
    assert tf._rel(out, io[f"T{{t}}.out"]) < 1e-2
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
