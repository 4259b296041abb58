"""The original's ``kt_kernel.utils.loader`` names for scripts that read weight files
themselves: ``SafeTensorLoader`` (converted AMXINT8/AMXINT4 files, any safetensors tensor),
``GGUFLoader`` (GGUF files and folders), ``translate_name_to_gguf``, and the ggml type table.
The per-format native loaders (``FP8SafeTensorLoader``, ``BF16SafeTensorLoader``,
``CompressedSafeTensorLoader``, ``GPTQSafeTensorLoader``, ``MXFP4SafeTensorLoader``,
``NVFP4SafeTensorLoader``, ``MXFP8SafeTensorLoader``) live in ``native_loaders`` and are
importable from here. The wrappers use none of these (the native layer reads the files).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

try:  # gguf is a test dependency, not a runtime one
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
except ImportError:  # pragma: no cover - exercised only without gguf
    GGML_QUANT_SIZES = GGMLQuantizationType = GGUFReader = None

__all__ = [
    "BF16SafeTensorLoader",
    "CompressedSafeTensorLoader",
    "FP8SafeTensorLoader",
    "GPTQSafeTensorLoader",
    "MXFP4SafeTensorLoader",
    "MXFP8SafeTensorLoader",
    "NVFP4SafeTensorLoader",
    "GGML_QUANT_SIZES",
    "GGMLQuantizationType",
    "GGUFLoader",
    "SafeTensorLoader",
    "translate_name_to_gguf",
]

_PROJECTIONS = ("up", "gate", "down")


class SafeTensorLoader:
    """Every tensor of the ``.safetensors`` files under ``file_path`` (a file or a folder,
    searched recursively), read on demand."""

    def __init__(self, file_path: str) -> None:
        root = Path(file_path)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(root.rglob("*.safetensors"))
        else:
            raise FileNotFoundError(f"no such file or folder: {file_path}")
        if not files:
            raise FileNotFoundError(f"no .safetensors files under {file_path}")
        self.tensor_file_map: dict[str, str] = {}
        self.file_handle_map: dict[str, object] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    self.tensor_file_map.setdefault(key, str(f))

    def _handle(self, file: str):
        h = self.file_handle_map.get(file)
        if h is None:
            h = safe_open(file, framework="pt")
            self.file_handle_map[file] = h
        return h

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_file_map

    def load_tensor(self, key: str, device: str = "cpu") -> torch.Tensor:
        file = self.tensor_file_map.get(key)
        if file is None:
            raise KeyError(f"Key {key} not found in Safetensor files")
        return self._handle(file).get_tensor(key).to(device)

    def close_all_handles(self) -> None:
        self.file_handle_map.clear()

    def load_experts(self, base_key: str, device: str = "cpu") -> dict[str, list]:
        """The converted experts of ``base_key`` (``blk.L``): for ``up``, ``gate``, ``down`` and
        their ``*_scale``, lists ``[numa][expert]`` of numpy arrays, read from
        ``{base_key}.ffn_{proj}_exps.{expert}.numa.{numa}.{weight,scale}``."""
        up = f"{base_key}.ffn_up_exps"
        experts = 0
        while self.has_tensor(f"{up}.{experts}.numa.0.weight"):
            experts += 1
        if experts == 0:
            raise ValueError(f"No experts found for key {base_key}")
        parts = 0
        while self.has_tensor(f"{up}.0.numa.{parts}.weight"):
            parts += 1
        out: dict[str, list] = {}
        for proj in _PROJECTIONS:
            for kind, suffix in (("", "weight"), ("_scale", "scale")):
                out[proj + kind] = [
                    [
                        self.load_tensor(
                            f"{base_key}.ffn_{proj}_exps.{e}.numa.{n}.{suffix}", device
                        ).numpy()
                        for e in range(experts)
                    ]
                    for n in range(parts)
                ]
        return out


# Hugging Face name pieces and their GGUF spelling, applied in order.
_GGUF_NAMES = [
    ("model.embed_tokens.", "token_embd."),
    ("lm_head.", "output."),
    ("model.norm.", "output_norm."),
    ("model.layers.", "blk."),
    (".input_layernorm", ".attn_norm"),
    (".post_attention_layernorm", ".ffn_norm"),
    (".self_attn.q_proj", ".attn_q"),
    (".self_attn.k_proj", ".attn_k"),
    (".self_attn.v_proj", ".attn_v"),
    (".self_attn.o_proj", ".attn_output"),
    (".self_attn.q_norm", ".attn_q_norm"),
    (".self_attn.k_norm", ".attn_k_norm"),
    (".self_attn.kv_a_proj_with_mqa", ".attn_kv_a_mqa"),
    (".self_attn.kv_a_layernorm", ".attn_kv_a_norm"),
    (".self_attn.kv_b_proj", ".attn_kv_b"),
    (".self_attn.q_a_proj", ".attn_q_a"),
    (".self_attn.q_a_layernorm", ".attn_q_a_norm"),
    (".self_attn.q_b_proj", ".attn_q_b"),
    (".mlp.shared_experts.gate_proj", ".ffn_gate_shexp"),
    (".mlp.shared_experts.up_proj", ".ffn_up_shexp"),
    (".mlp.shared_experts.down_proj", ".ffn_down_shexp"),
    (".mlp.gate.e_score_correction_bias", ".exp_probs_b.bias"),
    (".mlp.gate.", ".ffn_gate_inp."),
    (".block_sparse_moe.gate.", ".ffn_gate_inp."),
    (".mlp.gate_proj", ".ffn_gate"),
    (".mlp.up_proj", ".ffn_up"),
    (".mlp.down_proj", ".ffn_down"),
    (".mlp.experts", ""),
    (".block_sparse_moe.experts", ""),
]


def translate_name_to_gguf(name: str) -> str:
    """A Hugging Face tensor name in GGUF's spelling (``model.layers.3.mlp.experts`` →
    ``blk.3``, ``...self_attn.q_proj.weight`` → ``...attn_q.weight``)."""
    for hf, gguf_name in _GGUF_NAMES:
        name = name.replace(hf, gguf_name)
    return name


class GGUFLoader:
    """Tensors and metadata of a ``.gguf`` file or of every ``.gguf`` file in a folder."""

    def __init__(self, gguf_path: str) -> None:
        if GGUFReader is None:
            raise ImportError("GGUFLoader needs the gguf package (pip install gguf)")
        path = Path(gguf_path)
        if not path.exists():
            raise FileNotFoundError(f"GGUF path not found: {gguf_path}")
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix == ".gguf")
            if not files:
                raise FileNotFoundError(f"no .gguf files in {gguf_path}")
        elif path.suffix == ".gguf":
            files = [path]
        else:
            raise ValueError(f"Path must be a .gguf file or a directory: {gguf_path}")
        self.metadata: dict[str, object] = {}
        self.tensor_info: dict[str, dict] = {}
        self.tensor_file_map: dict[str, str] = {}
        self._tensors: dict[str, object] = {}
        for f in files:
            reader = GGUFReader(str(f))
            for key, field in reader.fields.items():
                if key.startswith("GGUF."):
                    continue
                self.metadata.setdefault(key, _field_value(field))
            for t in reader.tensors:
                self._tensors[t.name] = t
                self.tensor_file_map[t.name] = str(f)
                self.tensor_info[t.name] = {
                    "shape": [int(d) for d in reversed(t.shape.tolist())],
                    "ggml_type": int(t.tensor_type),
                    "offset": int(t.data_offset),
                }

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_info

    def get_ggml_type(self, name: str) -> int:
        if name not in self.tensor_info:
            raise KeyError(f"tensor {name} not found in the GGUF files")
        return self.tensor_info[name]["ggml_type"]

    def get_undequanted_tensor_and_ggml_type(self, name: str) -> tuple[torch.Tensor, int]:
        """The tensor's raw bytes (uint8, a read-only view of the mapped file: do not write
        to it) and its ggml type."""
        if name not in self._tensors:
            raise KeyError(f"tensor {name} not found in the GGUF files")
        t = self._tensors[name]
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        with warnings.catch_warnings():
            # A read-only view of the mapped file: callers read it (as the original's do).
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw), int(t.tensor_type)

    def get_model_config(self, layer_idx: int = 0) -> dict[str, int | None]:
        """``num_experts``, ``num_experts_per_tok``, ``hidden_size`` and
        ``moe_intermediate_size`` from the metadata (and the expert tensors' shapes)."""
        arch = self.metadata.get("general.architecture", "unknown")

        def meta(*suffixes):
            for s in suffixes:
                value = self.metadata.get(f"{arch}.{s}")
                if value is not None:
                    return int(value)
            return None

        config = {
            "num_experts": meta("expert_count"),
            "num_experts_per_tok": meta("expert_used_count"),
            "hidden_size": meta("embedding_length"),
            "moe_intermediate_size": meta("expert_feed_forward_length"),
        }
        gate = self.tensor_info.get(f"blk.{layer_idx}.ffn_gate_exps.weight")
        if gate is not None:  # [experts, intermediate, hidden] once reversed to row-major
            e, i, h = gate["shape"]
            config["num_experts"] = config["num_experts"] or e
            config["moe_intermediate_size"] = config["moe_intermediate_size"] or i
            config["hidden_size"] = config["hidden_size"] or h
        return config

    def print_metadata(self, filter_keywords=None) -> None:
        for key, value in self.metadata.items():
            if not filter_keywords or any(k in key for k in filter_keywords):
                print(f"  {key}: {value}")


def _field_value(field):
    """A GGUF metadata field as a Python value (strings decoded, one-element arrays unwrapped)."""
    parts = [field.parts[i] for i in field.data]
    if not parts:
        return None
    try:
        from gguf import GGUFValueType

        if field.types and field.types[-1] == GGUFValueType.STRING:
            strings = [bytes(p).decode("utf-8", "replace") for p in parts]
            return strings[0] if len(strings) == 1 else strings
    except ImportError:  # pragma: no cover
        pass
    values = [p.tolist() for p in parts]
    flat = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
    return flat[0] if len(flat) == 1 else flat


# At the end: the native loaders build on SafeTensorLoader above.
from .native_loaders import (  # noqa: E402
    BF16SafeTensorLoader,
    CompressedSafeTensorLoader,
    FP8SafeTensorLoader,
    GPTQSafeTensorLoader,
    MXFP4SafeTensorLoader,
    MXFP8SafeTensorLoader,
    NVFP4SafeTensorLoader,
)
