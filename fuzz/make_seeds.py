"""Write the seed corpora of the fuzz targets (small valid inputs of each parser) into
fuzz/corpus/<target>/. Run with the project's venv: python fuzz/make_seeds.py"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import save_file

HERE = Path(__file__).parent
CORPUS = HERE / "corpus"


def put(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def hf_checkpoint(folder: Path, e=2, h=64, i=64) -> None:
    g = torch.Generator().manual_seed(0)
    t = {}
    for x in range(e):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
            t[f"model.layers.0.mlp.experts.{x}.{name}.weight"] = w
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {"hidden_size": h, "moe_intermediate_size": i, "num_experts": e}
    (folder / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 1}))


def main() -> int:
    work = Path(tempfile.mkdtemp())
    hf_checkpoint(work / "hf")
    put("safetensors", "experts-bf16", (work / "hf" / "model.safetensors").read_bytes())
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(work / "small"))
    put("safetensors", "small-f32", (work / "small").read_bytes())

    index = {"metadata": {"total_size": 10}, "weight_map": {
        "model.layers.0.mlp.experts.0.gate_proj.weight": "model-00001-of-00002.safetensors",
        "model.layers.1.mlp.experts.0.gate_proj.weight": "model-00002-of-00002.safetensors"}}
    put("shard_index", "index", json.dumps(index).encode())

    writer = GGUFWriter(str(work / "m.gguf"), "qwen3moe")
    writer.add_expert_count(2)
    writer.add_string("general.name", "seed")
    writer.add_array("seed.list", [1, 2, 3])
    q8 = GGMLQuantizationType.Q8_0
    raw = np.random.default_rng(0).integers(0, 255, size=(2, 4, 34), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_dtype=q8)
    writer.add_tensor("blk.0.ffn_down_exps.weight", np.ones((2, 32, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    put("gguf", "two-tensors", (work / "m.gguf").read_bytes())

    out = work / "int8"
    args = ["-i", str(work / "hf"), "-o", str(out), "--quant-method", "int8",
            "--threadpool-count", "1", "-q"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "kt_kernel.convert", *args], check=True)
    shard = max(out.glob("*.safetensors"), key=lambda p: p.stat().st_size)  # the experts
    put("converted_merged", "int8-e2", shard.read_bytes())

    kt = work / "kt"
    subprocess.run([sys.executable, "-m", "kt_kernel.convert", *args[:3], str(kt), *args[4:],
                    "--no-merge-safetensor"], check=True)  # fmt: skip
    names = []
    for prefix in ["INT8", "INT4"]:
        for e in range(2):
            for proj in ["gate", "up", "down"]:
                for kind in ["quant", "scale"]:
                    names.append((prefix, e, proj, kind))
    records = b""
    for f in sorted((kt / "_layer_0" / "_numa_0").iterdir()):
        prefix, proj, e, _, kind, _ = f.name.split("_")
        pick = names.index((prefix, int(e), proj, kind))
        body = f.read_bytes()
        records += struct.pack("<BH", pick, len(body)) + body
    put("converted_kt", "int8-e2", records)
    print(f"seeds written to {CORPUS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
