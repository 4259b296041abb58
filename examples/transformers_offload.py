"""Run a Hugging Face MoE model's routed experts on the CPU with kt-kernel.

    python examples/transformers_offload.py                      # a tiny random Qwen3-MoE
    python examples/transformers_offload.py --model /models/Qwen3-30B-A3B --method BF16
    python examples/transformers_offload.py --method AMXINT8     # converts first (kt quant)

It loads the model with ``transformers`` (its experts' weights are read once more by
kt-kernel from the same checkpoint), replaces every sparse-MoE block's experts with
``KTMoEWrapper`` through ``kt_kernel.transformers_moe.offload_experts``, and greedily generates
from a prompt; with ``--compare`` it also runs the untouched model and reports the difference.
``--gpu-experts N`` keeps the first N experts of each layer in torch, as hybrid serving keeps
hot experts on the GPU. Tiny models are random: their text is noise, their numbers are not.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers
from kt_kernel import convert
from kt_kernel.transformers_moe import offload_experts


def tiny_model(folder: Path) -> None:
    """Write a random two-layer Qwen3-MoE model (8 experts, top-2) to ``folder``."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Hugging Face MoE checkpoint (default: tiny random)")
    p.add_argument("--method", default="BF16", help="BF16, AMXINT8, FP8, ...")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--gpu-experts", type=int, default=0, help="experts per layer kept in torch")
    p.add_argument("--tokens", type=int, default=20, help="tokens to generate")
    p.add_argument("--compare", action="store_true", help="also run the untouched torch model")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kt-example-"))
    model_dir = Path(args.model) if args.model else work / "tiny-qwen3-moe"
    if not args.model:
        tiny_model(model_dir)
    weights = model_dir
    if args.method in ("AMXINT8", "AMXINT4"):
        weights = work / args.method.lower()
        quant = "int8" if args.method == "AMXINT8" else "int4"
        convert.main(
            [
                "-i",
                str(model_dir),
                "-o",
                str(weights),
                "--quant-method",
                quant,
                "--threadpool-count",
                "1",
                "-q",
            ]
        )

    load = dict(dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
    experts = model.config.num_experts if hasattr(model.config, "num_experts") else None
    experts = experts or model.config.num_local_experts
    mask = torch.zeros(experts, dtype=torch.bool)
    mask[: args.gpu_experts] = True
    modules = offload_experts(
        model,
        str(weights),
        method=args.method,
        cpuinfer_threads=args.threads,
        gpu_experts_mask=mask,
    )
    print(
        f"{len(modules)} MoE layers on kt-kernel ({args.method}, kernel "
        f"{modules[0].wrapper.moe.kernel})"
    )

    prompt = torch.tensor([[3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64]])
    gen = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        ours = model.generate(prompt, **gen)[0, prompt.shape[1] :]
        dt = time.perf_counter() - t0
        print(f"kt-kernel: {ours.tolist()} ({args.tokens / dt:.1f} tokens/s)")
        if args.compare:
            ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **load)
            ref_model.eval()
            ref = ref_model.generate(prompt, **gen)[0, prompt.shape[1] :]
            a, b = model(prompt).logits.double(), ref_model(prompt).logits.double()
            print(f"torch:     {ref.tolist()}")
            print(
                f"same tokens: {ours.tolist() == ref.tolist()}, "
                f"logits rel L2 {((a - b).norm() / b.norm()).item():.2e}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
