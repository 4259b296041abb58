"""A real model end to end: tiny Mixtral and Qwen3-MoE models built with Hugging Face
``transformers`` (random weights, CPU), saved as safetensors checkpoints, with every
sparse-MoE block's experts replaced by ``KTMoEWrapper`` over that checkpoint
(``kt_kernel.transformers_moe.offload_experts``): BF16 straight from the checkpoint, AMXINT8
through the converter, FP8 from a block-quantized checkpoint. The untouched torch model is
the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kt_kernel import convert  # noqa: E402
from kt_kernel.transformers_moe import KTExperts, moe_layers, offload_experts  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_fp8 import quantize_fp8_blocks  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
SHAPE.update(num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)


def _mixtral():
    cfg = transformers.MixtralConfig(
        intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, **SHAPE
    )
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=32,
        norm_topk_prob=True,
        **SHAPE,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


MODELS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe}


def _build(kind: str, folder: Path) -> torch.nn.Module:
    """A float32 model whose weights are exactly bf16 values, saved in bf16 to ``folder`` (the
    checkpoint then holds the very weights the reference computes with)."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.to(torch.bfloat16).save_pretrained(folder)
    model.float().eval()
    return model


def _load(kind: str, folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = _build(request.param, folder)
    return request.param, folder, reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


PROMPT = torch.tensor([[3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


def _greedy(model, n=20) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            PROMPT, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, PROMPT.shape[1] :].tolist()


def test_every_moe_block_is_found(checkpoint):
    _, folder, reference = checkpoint
    layers = [idx for idx, _, _ in moe_layers(reference)]
    assert layers == [0, 1]


def test_bf16_logits_and_twenty_greedy_tokens_match_the_torch_model(checkpoint):
    kind, folder, reference = checkpoint
    model = _load(kind, folder)
    modules = offload_experts(model, str(folder), method="BF16", cpuinfer_threads=2)
    assert len(modules) == 2 and all(isinstance(m, KTExperts) for m in modules)
    # Nothing of the torch experts is left behind when no expert stays in torch.
    assert all(m.torch_experts is None for m in modules)
    ref, ours = _logits(reference), _logits(model)
    # bf16 tolerance: the kernels round activations to bf16 for the bf16 dot product.
    assert _rel(ours, ref) < 1e-2, _rel(ours, ref)
    tokens = _greedy(model)
    assert tokens == _greedy(reference)
    assert len(set(tokens)) > 1, "a degenerate model would hide a broken forward"


def test_experts_kept_in_torch_by_a_gpu_mask_give_the_same_model(checkpoint):
    kind, folder, reference = checkpoint
    model = _load(kind, folder)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, ::2] = True  # layer 0: even experts "on the GPU"
    mask[1, :3] = True  # layer 1: experts 0-2
    modules = offload_experts(
        model, str(folder), method="BF16", cpuinfer_threads=2, gpu_experts_mask=mask
    )
    assert all(m.torch_experts is not None for m in modules)
    assert modules[0].wrapper.gpu_experts_mask.tolist() == mask[0].tolist()
    ref, ours = _logits(reference), _logits(model)
    assert _rel(ours, ref) < 1e-2, _rel(ours, ref)
    assert _greedy(model) == _greedy(reference)


def test_deferred_experts_of_the_last_moe_layer_are_not_dropped(checkpoint):
    # A layer's deferred experts are added by the next MoE layer; the last one has none after
    # it, so offload_experts computes all of its experts at once.
    kind, folder, reference = checkpoint
    model = _load(kind, folder)
    modules = offload_experts(
        model, str(folder), method="BF16", cpuinfer_threads=2, max_deferred_experts_per_token=1
    )
    assert [m.wrapper.max_deferred_experts_per_token for m in modules] == [1, 0]
    # The last MoE block alone gives every expert's output, as the torch block does (with 1
    # it had dropped the deferred ones: 0.42 relative error).
    x = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, ref = model.model.layers[-1].mlp(x), reference.model.layers[-1].mlp(x)
    ours, ref = (t[0] if isinstance(t, tuple) else t for t in (ours, ref))
    assert _rel(ours, ref) < 1e-2, _rel(ours, ref)


def test_gpu_masks_that_offload_cannot_honour_are_refused(checkpoint):
    kind, folder, _ = checkpoint
    model = _load(kind, folder)
    args = dict(method="BF16", cpuinfer_threads=2)
    with pytest.raises(TypeError, match="bool"):
        offload_experts(model, str(folder), gpu_experts_mask=torch.full((8,), 0.5), **args)
    with pytest.raises(ValueError, match="one row per"):
        offload_experts(model, str(folder), gpu_experts_mask=torch.zeros(3, 8, dtype=bool), **args)
    masked = torch.zeros(8, dtype=torch.bool)
    masked[::2] = True
    with pytest.raises(ValueError, match="nothing would compute them"):
        offload_experts(
            model, str(folder), gpu_experts_mask=masked, keep_torch_experts=False, **args
        )


def test_amxint8_from_the_converter_tracks_the_torch_model(checkpoint, tmp_path):
    kind, folder, reference = checkpoint
    out = tmp_path / "int8"
    args = ["-i", str(folder), "-o", str(out), "--quant-method", "int8"]
    assert convert.main([*args, "--threadpool-count", "1", "-q"]) == 0
    model = _load(kind, folder)
    offload_experts(model, str(out), method="AMXINT8", cpuinfer_threads=2)
    ref, ours = _logits(reference), _logits(model)
    # Per-row int8 weights and activations: a few percent on the logits.
    assert _rel(ours, ref) < 5e-2, _rel(ours, ref)


def _fp8_checkpoint(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """``folder``'s checkpoint with every expert projection block-quantized to FP8 (128 × 128
    blocks, ``weight_scale_inv``); returns the dequantized expert weights by tensor name."""
    tensors = load_file(str(folder / "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if ".experts." in n and n.endswith(".weight")]:
        codes, scale = quantize_fp8_blocks(tensors[name].float())
        tensors[name] = codes
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
        blocks = codes.float().reshape(codes.shape[0] // 128, 128, codes.shape[1] // 128, 128)
        dequantized[name] = (blocks * scale[:, None, :, None]).reshape(codes.shape)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


def test_fp8_checkpoint_matches_the_model_with_its_dequantized_weights(checkpoint, tmp_path):
    kind, folder, _ = checkpoint
    dequantized = _fp8_checkpoint(folder, tmp_path / "fp8")
    # Reference: the torch model computing with exactly the FP8 checkpoint's values.
    reference = _load(kind, folder)
    with torch.no_grad():
        for idx, block, attr in moe_layers(reference):
            experts = getattr(block, attr)
            mixtral = f"model.layers.{idx}.block_sparse_moe.experts"
            if any(n.startswith(mixtral) for n in dequantized):
                prefix, names = mixtral, ("w1", "w3", "w2")
            else:
                prefix = f"model.layers.{idx}.mlp.experts"
                names = ("gate_proj", "up_proj", "down_proj")
            for e in range(experts.gate_up_proj.shape[0]):
                g, u, d = (dequantized[f"{prefix}.{e}.{n}.weight"] for n in names)
                experts.gate_up_proj[e].copy_(torch.cat([g, u]))
                experts.down_proj[e].copy_(d)
    model = _load(kind, folder)
    offload_experts(model, str(tmp_path / "fp8"), method="FP8", cpuinfer_threads=2)
    ref, ours = _logits(reference), _logits(model)
    assert _rel(ours, ref) < 1e-2, _rel(ours, ref)
    assert _greedy(model) == _greedy(reference)


def test_models_without_moe_blocks_or_with_another_activation_are_refused():
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=256, **SHAPE))
    with pytest.raises(ValueError, match="no fused sparse-MoE experts"):
        offload_experts(dense, "/nonexistent")
    model = _mixtral()
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="SiLU"):
        offload_experts(model, "/nonexistent")


def test_the_example_script_runs_and_matches_torch():
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "examples" / "transformers_offload.py"
    r = subprocess.run(
        [sys.executable, str(script), "--compare", "--tokens", "8", "--gpu-experts", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "same tokens: True" in r.stdout, r.stdout
