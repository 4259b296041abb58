"""The converter (``python -m kt_kernel.convert`` / ``kt quant``): the original's bytes on its own
fixture, sharded multi-layer checkpoints in every input precision that load into the same
layers as online quantization, clear errors, and interrupted runs that resume cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_wrapper, random_routing, reference_moe, rel_l2
from kt_kernel import convert
from kt_kernel.__main__ import main as kt_main
from safetensors import safe_open
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "amx"


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")
@pytest.mark.parametrize(("method", "tp", "layout"), [("int8", 1, "merged"), ("int4", 2, "kt")])
def test_fixture_checkpoint_gives_the_originals_files(tmp_path, method, tp, layout):
    out = tmp_path / "out"
    args = [
        "--input-path",
        str(FIXTURES / "hf"),
        "--input-type",
        "bf16",
        "--output",
        str(out),
        "--quant-method",
        method,
        "--cpuinfer-threads",
        "2",
        "--threadpool-count",
        str(tp),
    ]
    if layout == "kt":
        args.append("--no-merge-safetensor")
    assert convert.main(args) == 0
    assert tree(out) == tree(FIXTURES / f"{method}-tp{tp}-{layout}")


E, K, H, I = 6, 2, 256, 256  # noqa: E741 (the model's own letters)


def experts(layer: int, e=E, h=H, i=I):
    g = torch.Generator().manual_seed(100 + layer)
    mk = lambda *s: torch.randn(*s, generator=g) * 0.03  # noqa: E731
    return mk(e, i, h), mk(e, i, h), mk(e, h, i)


def to_fp8(w: torch.Tensor):
    """Block-FP8 (128x128, scale = block amax / 448) as DeepSeek-V3 stores it."""
    n, k = w.shape
    blocks = w.reshape(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale.float().contiguous()


def write_checkpoint(path: Path, layers: int, dtype: str, e=E, h=H, i=I) -> None:
    """Layer 0 dense, MoE layers 1.., one shard per layer, an index, config and tokenizer."""
    path.mkdir()
    weight_map = {}
    for layer in range(layers):
        t = {f"model.layers.{layer}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        if layer > 0:
            for x, mats in enumerate(zip(*experts(layer, e, h, i), strict=True)):
                for name, m in zip(("gate_proj", "up_proj", "down_proj"), mats, strict=True):
                    key = f"model.layers.{layer}.mlp.experts.{x}.{name}.weight"
                    if dtype == "fp8":
                        t[key], t[key + "_scale_inv"] = to_fp8(m)
                    else:
                        t[key] = m.to({"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
        file = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in t.items()}, str(path / file))
        weight_map.update(dict.fromkeys(t, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "hidden_size": h,
        "moe_intermediate_size": i,
        "num_experts": e,
        "num_experts_per_tok": K,
    }
    if dtype == "fp8":
        config["quantization_config"] = {"weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text("{}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8"])
def test_sharded_checkpoints_convert_and_load_like_online_quantization(tmp_path, dtype):
    src, out = tmp_path / "hf", tmp_path / "out"
    write_checkpoint(src, 3, dtype)
    # The engine (and its part count) is per process, as in the original: convert for it.
    parts = make_wrapper().cpu_infer.engine.parts
    status = kt_main(
        [
            "quant",
            str(src),
            "--method",
            "int8",
            "--output",
            str(out),
            "--input-type",
            dtype,
            "--cpu-threads",
            "2",
            "--numa-nodes",
            str(parts),
            "-q",
        ]
    )
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "tokenizer_config.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    key = f"blk.2.ffn_up_exps.5.numa.{parts - 1}.scale"
    assert index[key] == "model-00002-of-00003.safetensors"
    assert index["blk.0.input_layernorm.weight"] == "model-00003-of-00003.safetensors"
    with safe_open(str(out / "model-00001-of-00003.safetensors"), "pt") as f:
        assert f.get_tensor("blk.1.ffn_down_exps.0.numa.0.weight").dtype == torch.int8
    x = torch.randn(7, H).to(torch.bfloat16)
    ids, wt = random_routing(7, E, K, seed=4)
    for layer in (1, 2):
        outs = []
        for path in (out, src):  # converted files, then the checkpoint quantized online
            w = make_wrapper(
                layer_idx=layer,
                e=E,
                k=K,
                h=H,
                i=I,
                threadpool_count=parts,
                method="AMXINT8",
                weight_path=str(path),
            )
            w.load_weights(torch.arange(E))
            outs.append(w.forward(x, ids, wt, None))
        assert torch.equal(outs[0], outs[1])
        g, u, d = experts(layer)
        assert rel_l2(outs[0], reference_moe(x, ids, wt, g, u, d)) < (
            0.06 if dtype == "fp8" else 0.03
        )


def test_bad_options_and_inputs_exit_with_a_message(tmp_path, capsys):
    src = tmp_path / "hf"
    write_checkpoint(src, 2, "fp16")
    base = ["--input-path", str(src), "--output", str(tmp_path / "o")]
    assert convert.main(base + ["--input-type", "bf16", "-q"]) == 1
    assert "float16" in capsys.readouterr().err
    assert convert.main(base + ["--quant-method", "awq", "-q"]) == 1
    assert "only int8 and int4" in capsys.readouterr().err
    assert (
        convert.main(["--input-path", str(tmp_path / "none"), "--output", str(tmp_path / "o")]) == 1
    )
    assert "is not a checkpoint folder" in capsys.readouterr().err
    # I = 256 in 4 parts = 64 per part: not whole 128-input tiles for int4.
    assert convert.main(base + ["--quant-method", "int4", "--threadpool-count", "4", "-q"]) == 1
    assert "64 per part" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main(base + ["--quant-method", "int3"])
    for flag, value in (
        ("--threadpool-count", "-1"),
        ("--cpuinfer-threads", "-1"),
        ("--cpuinfer-threads", str(1 << 40)),
        ("--resume-layer", "-1"),
    ):
        assert convert.main(base + [flag, value, "-q"]) == 2
        assert f"{flag} must be" in capsys.readouterr().err
    # An output path that is a file: the message names it.
    (tmp_path / "file").write_text("")
    assert convert.main(["-i", str(src), "-o", str(tmp_path / "file"), "-q"]) == 1
    assert str(tmp_path / "file") in capsys.readouterr().err
    # Converted for 2 parts, served with 1: refused, naming both.
    out = tmp_path / "o2"
    assert convert.main(["-i", str(src), "-o", str(out), "--quant-method", "int8", "-q"]) == 0
    # (In a fresh process: the engine, and so the part count, is per process, as in the original.)
    code = (
        "import torch, sys; sys.path.insert(0, sys.argv[1]); from conftest import make_wrapper; "
        f"w = make_wrapper(layer_idx=1, e={E}, k={K}, h={H}, i={I}, method='AMXINT8', "
        f"weight_path={str(out)!r}); w.load_weights(torch.arange({E}))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True
    )
    assert r.returncode != 0 and "ValueError" in r.stderr, r.stderr
    assert "--threadpool-count 2" in r.stderr and "threadpool_count=1" in r.stderr


def test_interrupted_run_leaves_only_complete_files_and_resumes(tmp_path):
    src, full, part = tmp_path / "hf", tmp_path / "full", tmp_path / "part"
    # Big enough (8 x 25 MB) that a run is still going when the first layer is reported.
    write_checkpoint(src, 9, "bf16", e=8, h=512, i=1024)
    args = ["-i", str(src), "--quant-method", "int4", "--threadpool-count", "1"]
    assert convert.main(args + ["--output", str(full), "-q"]) == 0

    def start(out: Path) -> subprocess.Popen:
        code = "import sys; from kt_kernel import convert; sys.exit(convert.main(sys.argv[1:]))"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args, "--output", str(out)],
            stderr=subprocess.PIPE,
            text=True,
        )
        proc.stderr.readline()  # the first finished layer
        return proc

    proc = start(part)
    proc.send_signal(signal.SIGKILL)  # no clean-up at all
    proc.communicate()
    done = sorted(p.name for p in part.iterdir() if ".partial-" not in p.name)
    # Whatever got a final name is complete (the reader checks every tensor's offsets).
    shards = [n for n in done if n.startswith("model-")]
    for name in shards:
        with safe_open(str(part / name), "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    assert 1 <= len(shards) <= 9, done
    # MoE layer i lives in shard i; continue after the last complete one.
    status = convert.main(args + ["--output", str(part), "--resume-layer", str(len(shards) + 1)])
    assert status == 0
    assert tree(part) == tree(full)
    # Ctrl-C: exit status 130, the hint to resume, no temporary files left.
    again = tmp_path / "again"
    proc = start(again)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 130:
        assert "--resume-layer" in err
        assert not any(".partial-" in p.name for p in again.iterdir())
    else:
        # It finished before the signal arrived (0), or the signal came while the interpreter
        # was shutting down after the conversion (killed by SIGINT: a fast CPU converts this
        # test's 8 small layers in 0.1 s). Either way every file is complete.
        assert proc.returncode in (0, -signal.SIGINT), err
        assert tree(again) == tree(full)
