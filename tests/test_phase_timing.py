"""KT_MOE_PHASE_TIMING / KT_MOE_PHASE_TIMING_INTERVAL: per-layer phase times on stderr."""

import os
import re
import subprocess
import sys

import torch

RUN = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_wrapper, random_experts, random_routing
g, u, d = random_experts(8, 64, 128, seed=4)
w = make_wrapper(layer_idx=5, e=8, k=2, h=64, i=128, threadpool_count={parts})
w.load_weights_from_tensors(g, u, d)
outs = []
for call in range(5):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(call)).to(torch.bfloat16)
    ids, wt = random_routing(3, 8, 2, seed=call)
    outs.append(w.forward(x, ids, wt, None))
torch.save(torch.stack(outs), {out!r})
"""

PHASES = ["route", "gather x", "gate/up+SwiGLU", "SwiGLU rows", "down", "finish", "merge"]


def run(tmp_path, parts, **env_vars):
    out = tmp_path / f"out-{parts}-{len(env_vars)}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_MOE_PHASE_TIMING")}
    env.update(env_vars)
    code = RUN.format(tests=os.path.dirname(__file__), parts=parts, out=str(out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [s for s in r.stderr.splitlines() if "phase timing" in s]
    return lines, torch.load(out)


def test_phase_times_are_reported_every_interval_and_change_nothing(tmp_path):
    for parts in (1, 2):
        lines, timed = run(
            tmp_path, parts, KT_MOE_PHASE_TIMING="1", KT_MOE_PHASE_TIMING_INTERVAL="2"
        )
        # Five calls, a report after the second and the fourth.
        assert len(lines) == 2, lines
        for line in lines:
            assert line.startswith("kt_kernel phase timing: layer 5, 2 calls, 3.0 tokens"), line
            values = dict(re.findall(r"([a-zA-Z/+ ]+?) (\d+\.\d{3})", line.split(": ", 2)[2]))
            values = {k.strip(", "): float(v) for k, v in values.items()}
            assert set(PHASES + ["other", "total"]) == set(values), values
            assert all(v >= 0 for v in values.values()), values
            phases = sum(values[p] for p in PHASES)
            assert phases <= values["total"] + 0.002, values
            assert values["gate/up+SwiGLU"] > 0 and values["down"] > 0, values
        untimed_lines, untimed = run(tmp_path, parts)
        assert untimed_lines == []
        assert torch.equal(timed, untimed)


def test_timing_off_values_print_nothing(tmp_path):
    lines, _ = run(tmp_path, 1, KT_MOE_PHASE_TIMING="0", KT_MOE_PHASE_TIMING_INTERVAL="1")
    assert lines == []
