"""``kt_kernel_ext.moe``: the original's low-level MoE classes over this library's native layer.

Scripts written against the original's low-level API run unchanged on CPU tensors::

    cpu_infer = kt_kernel_ext.CPUInfer(2)
    config = kt_kernel_ext.moe.MOEConfig(E, k, H, I, 0)
    config.pool = cpu_infer.backend_
    config.max_len = 64
    config.gate_proj, config.up_proj, config.down_proj = (t.data_ptr() for t in (g, u, d))
    moe = kt_kernel_ext.moe.AMXInt8_MOE(config)
    cpu_infer.submit(moe.load_weights_task(map.data_ptr()))
    cpu_infer.sync()
    cpu_infer.submit(moe.forward_task(bsz.data_ptr(), k, ids.data_ptr(), w.data_ptr(),
                                      x.data_ptr(), out.data_ptr(), False))
    cpu_infer.sync()

Conventions of the original: weights at ``gate_proj``/``up_proj``/``down_proj`` are bf16
``[E, I, H]``/``[E, I, H]``/``[E, H, I]`` (quantized at load by the quantized classes), or
``config.path`` names converted AMX files (AMXInt8/AMXInt4), a Hugging Face checkpoint
(the native classes) or a GGUF file/folder (``MOE``). ``forward_task`` reads the token count
from the int32 at ``qlen_ptr`` when it runs (at most ``max_len``); ids int64 ``[q, k]``,
weights fp32 ``[q, k]``, input and output bf16 ``[q, H]``. Tasks are process-lifetime
descriptors, so ``CPUInfer.submit_with_cuda_stream`` can order them on a CUDA stream and a
captured graph can replay them.

``forward_task(..., incremental=True)`` adds the bf16 values already in the output buffer (the
previous layer's deferred experts) to this layer's result before rounding it to bf16 once.

The native classes (and the BF16 ones) also take their experts the way the original's
``NativeMoEWrapper`` hands them over: ``config.gate_projs``/``up_projs``/``down_projs`` and
``gate_scales``/``up_scales``/``down_scales`` as ``[[address of expert 0, 1, ...]]`` (one NUMA
entry), each tensor in the layout its loader leaves in memory, and
``config.quant_config.group_size`` (the layouts: ``kt_core::expert_pointers``). AMXInt8_MOE and
AMXInt4_MOE take converted tensors the same way, ``[numa][expert]`` as
``kt_kernel.utils.loader.SafeTensorLoader.load_experts("blk.L")`` returns them (the original's
AMX wrapper over merged converted files), or ``config.path``. ``MOE`` (LLAMAFILE) takes the
stacked GGUF tensors by address with their ggml type ids (``gate_proj``/``gate_type``...), as
the original's LLAMAFILE wrapper passes them, or ``config.path``.

``run_layerwise_fp8_batch(transport, epoch, layer_id, expert_count)`` is rank zero's side of
layerwise prefill over a ``kt_kernel_ext.FP8LayerwiseTransport`` (``kt_core::layerwise``).

Not provided: the SFT classes.
"""

from __future__ import annotations

import torch

from . import _kt_core

_UNSET = 0
_GGML_BF16 = 30  # ggml's type id of bf16
_PROJS = ("gate", "up", "down")


class QuantConfig:
    """The original's quantization descriptor: ``bits``, ``group_size`` (read when experts are
    handed over by address), ``zero_point``, ``per_channel`` (the class decides the format)."""

    def __init__(self) -> None:
        self.quant_method = ""
        self.bits = 0
        self.group_size = 0
        self.zero_point = False
        self.per_channel = False


class MOEConfig:
    """The original's ``MOEConfig(expert_num, num_experts_per_tok, hidden_size,
    intermediate_size[, num_gpu_experts | gpu_experts_mask_ptr])``: a small fifth value is the
    legacy ``num_gpu_experts`` (ignored, as in the original), a large one a mask address."""

    def __init__(
        self,
        expert_num: int,
        num_experts_per_tok: int,
        hidden_size: int,
        intermediate_size: int,
        fifth: int = 0,
    ) -> None:
        self.expert_num = int(expert_num)
        self.num_experts_per_tok = int(num_experts_per_tok)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        # pybind11 tries the C int overload first: values that fit an int are num_gpu_experts.
        self._num_gpu_experts = int(fifth) if 0 <= int(fifth) < 2**31 else 0
        self.gpu_experts_mask = int(fifth) if int(fifth) >= 2**31 else _UNSET
        self.layer_idx = 0
        self.pool = None
        self.physical_to_logical_map = _UNSET
        self.gate_proj = self.up_proj = self.down_proj = _UNSET
        self.gate_scale = self.up_scale = self.down_scale = _UNSET
        self.gate_zero = self.up_zero = self.down_zero = _UNSET
        self.quant_config = QuantConfig()
        # [numa][expert] addresses (the original's per-expert form; one NUMA entry).
        self.gate_projs: list[list[int]] = []
        self.up_projs: list[list[int]] = []
        self.down_projs: list[list[int]] = []
        self.gate_scales: list[list[int]] = []
        self.up_scales: list[list[int]] = []
        self.down_scales: list[list[int]] = []
        self.max_len = 0
        self.path = ""
        self.save = False
        self.load = False
        self.m_block = 4
        self.group_min_len = 0
        self.group_max_len = 0
        self.max_cache_depth = 1
        self.swiglu_limit = 0.0
        self.swiglu_alpha = 0.0
        # ggml type ids of the MOE class's weights by address (-1: unset) and of its
        # activations (bf16 is what this library reads and writes).
        self.gate_type = self.up_type = self.down_type = -1
        self.hidden_type = _GGML_BF16

    @property
    def num_gpu_experts(self) -> int:
        return self._num_gpu_experts


class _HostTask:
    """A task run on the calling thread when submitted (loading and warm-up block in the
    original's tests anyway: they sync right after)."""

    def __init__(self, run) -> None:
        self._run = run

    def __call__(self) -> None:
        self._run()


class _MoE:
    """One layer of ``METHOD`` built from a :class:`MOEConfig`."""

    METHOD = "BF16"
    # Where config.path points for this class: "converted", "checkpoint" or "gguf".
    PATH_KIND = "checkpoint"
    # Whether pointer weights are bf16 values this class quantizes (else: native data).
    QUANTIZES_BF16 = True

    def __init__(self, config: MOEConfig) -> None:
        if not isinstance(config, MOEConfig):
            raise TypeError(f"{type(self).__name__} takes a MOEConfig")
        engine = config.pool
        if not isinstance(engine, _kt_core.Engine):
            raise ValueError("config.pool must be a CPUInfer's backend_ (cpu_infer.backend_)")
        self.config = config
        self.engine = engine
        self.max_len = max(1, int(config.max_len))
        e, h = config.expert_num, config.hidden_size
        self._mask = torch.zeros(e, dtype=torch.bool)
        self._mask_ptr = config.gpu_experts_mask or self._mask.data_ptr()
        self.layer = _kt_core.MoeLayer(
            engine,
            int(config.layer_idx),
            e,
            config.num_experts_per_tok,
            h,
            config.intermediate_size,
            self.max_len,
            float(config.swiglu_limit),
            float(config.swiglu_alpha),
            method=self.METHOD,
        )

    # -------------------------------------------------------------------------- loading
    def load_weights(self, physical_to_logical_map: int = 0) -> None:
        c = self.config
        map_ptr = int(physical_to_logical_map) or int(c.physical_to_logical_map)
        map_len = c.expert_num if map_ptr else 0
        if c.path:
            loader = {
                "converted": self.layer.load_from_converted,
                "checkpoint": self.layer.load_from_checkpoint,
                "gguf": self.layer.load_from_gguf,
            }[self.PATH_KIND]
            loader(c.path, int(c.layer_idx), map_ptr, map_len)
            return
        if self.PATH_KIND == "gguf" and c.gate_proj and c.gate_type >= 0:
            # The original's LLAMAFILE wrapper: GGUF tensors [E, I, H] by address with types.
            if int(c.hidden_type) != _GGML_BF16:
                raise NotImplementedError(
                    f"hidden_type {c.hidden_type}: activations are bf16 (ggml type 30) here"
                )
            types = [int(t) for t in (c.gate_type, c.up_type, c.down_type)]
            ptrs = [int(p) for p in (c.gate_proj, c.up_proj, c.down_proj)]
            self.layer.load_ggml_from_addresses(*ptrs, *types, map_ptr, map_len)
            return
        if self.PATH_KIND == "converted" and any(c.gate_projs):
            # The original's AMX wrapper over merged converted files: [numa][expert] arrays.
            weights = [[[int(a) for a in n] for n in getattr(c, f"{p}_projs")] for p in _PROJS]
            scales = [[[int(a) for a in n] for n in getattr(c, f"{p}_scales")] for p in _PROJS]
            self.layer.load_converted_from_addresses(weights, scales, map_ptr, map_len)
            return
        if any(c.gate_projs) or any(c.up_projs) or any(c.down_projs):
            weights = [_one_numa_entry(c, f"{p}_projs") for p in _PROJS]
            scales = [_one_numa_entry(c, f"{p}_scales") for p in _PROJS]
            if not any(any(lst) for lst in scales):
                scales = [[], [], []]  # BF16: no scales (the original passes zeros)
            group = int(getattr(c.quant_config, "group_size", 0) or 0)
            self.layer.load_from_addresses(weights, scales, group, map_ptr, map_len)
            return
        if not (c.gate_proj and c.up_proj and c.down_proj):
            raise ValueError(
                "set config.gate_proj/up_proj/down_proj (bf16 weights), config.gate_projs/"
                "gate_scales/... (per-expert tensors by address) or config.path"
            )
        if not self.QUANTIZES_BF16 or c.gate_scale or c.up_scale or c.down_scale:
            raise NotImplementedError(
                f"{type(self).__name__}: config.gate_proj/up_proj/down_proj take bf16 [E, I, H] "
                "weights to quantize; pass this format's tensors per expert "
                "(config.gate_projs/gate_scales/...) or set config.path to the checkpoint"
            )
        self.layer.load_from_tensors(
            int(c.gate_proj),
            int(c.up_proj),
            int(c.down_proj),
            "bfloat16",
            c.expert_num,
            map_ptr,
            map_len,
        )

    def load_weights_task(self, physical_to_logical_map: int = 0) -> _HostTask:
        return _HostTask(lambda: self.load_weights(physical_to_logical_map))

    def warm_up(self) -> None:
        """Nothing to warm: the layer's buffers are planned when it is made."""

    def warm_up_task(self) -> _HostTask:
        return _HostTask(self.warm_up)

    # -------------------------------------------------------------------------- forward
    def forward_task(
        self,
        qlen_ptr: int,
        k: int,
        expert_ids: int,
        weights: int,
        input: int,  # noqa: A002 (the original's name)
        output: int,
        incremental: bool = False,
    ) -> int:
        if int(k) != self.config.num_experts_per_tok:
            raise ValueError(f"k={k} but the config has num_experts_per_tok="
                             f"{self.config.num_experts_per_tok}")  # fmt: skip
        if not qlen_ptr:
            raise ValueError("qlen_ptr must point to an int32 token count")
        return self.layer.stream_task(
            self.max_len,
            int(input),
            "bfloat16",
            int(expert_ids),
            "int64",
            int(weights),
            int(output),
            "bfloat16",
            # incremental: the output buffer is also the addend, read strip by strip before
            # each strip is written (the core allows exactly this overlap).
            residual_ptr=int(output) if incremental else 0,
            residual_dtype="bfloat16",
            mask_ptr=self._mask_ptr,
            bsz_ptr=int(qlen_ptr),
        )

    def write_weight_scale_to_buffer_task(
        self,
        gpu_tp_count: int,
        expert_id: int,
        w13_weight_ptrs: list[int],
        w13_scale_ptrs: list[int],
        w2_weight_ptrs: list[int],
        w2_scale_ptrs: list[int],
    ) -> _HostTask:
        """Queue (when submitted) the write of one expert into every GPU rank's buffers, in the
        bytes ``KTMoEWrapper.submit_write_weight_scale_to_buffer`` writes; ``CPUInfer.sync()``
        waits for it. Arguments are checked now."""
        ptrs = [[int(p) for p in lst] for lst in
                (w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs)]  # fmt: skip
        self.layer.gpu_rank_bytes(int(gpu_tp_count))  # raises for methods without a GPU layout
        return _HostTask(
            lambda: self.layer.submit_write_weight_scale_to_buffer(
                int(gpu_tp_count), int(expert_id), *ptrs
            )
        )

    def run_layerwise_fp8_batch(self, transport, epoch: int, layer_id: int, expert_count: int):
        """Rank zero of layerwise prefill: write this layer's first ``expert_count`` experts
        into every rank's host slots of ``transport`` as its ranks copy them to their GPUs;
        returns this rank's figures. Blocks (sync the engine first, as the original's wrapper
        does)."""
        return self.layer.run_layerwise_fp8_batch(
            transport, int(epoch), int(layer_id), int(expert_count)
        )

    def forward(self, qlen_ptr, k, expert_ids, weights, input, output, incremental=False):  # noqa: A002
        """Run ``forward_task`` now on the engine and wait for it."""
        task = self.forward_task(qlen_ptr, k, expert_ids, weights, input, output, incremental)
        self.engine.wait(self.engine.submit_task(task))


def _one_numa_entry(config: MOEConfig, field: str) -> list[int]:
    """``config.<field>`` as one list of expert addresses (``[[...]]``, one NUMA entry)."""
    value = getattr(config, field)
    if not value:
        return []
    if len(value) != 1:
        raise ValueError(
            f"config.{field} has {len(value)} NUMA entries; native-format experts are split at "
            "load, so pass one list of per-expert addresses ([[ptr_0, ptr_1, ...]])"
        )
    addrs = [int(a) for a in value[0]]
    if len(addrs) != config.expert_num:
        raise ValueError(
            f"config.{field} holds {len(addrs)} addresses; expert_num is {config.expert_num}"
        )
    return addrs


def _class(name: str, method: str, path_kind: str = "checkpoint", quantizes_bf16: bool = True):
    return type(name, (_MoE,), {"METHOD": method, "PATH_KIND": path_kind,
                                "QUANTIZES_BF16": quantizes_bf16,
                                "__doc__": f"The original's {name}: method {method}."})  # fmt: skip


AMXInt8_MOE = _class("AMXInt8_MOE", "AMXINT8", "converted")
AMXInt4_MOE = _class("AMXInt4_MOE", "AMXINT4", "converted")
AMXBF16_MOE = _class("AMXBF16_MOE", "BF16")
AVX2BF16_MOE = _class("AVX2BF16_MOE", "BF16")
AMXFP8_MOE = _class("AMXFP8_MOE", "FP8", quantizes_bf16=False)
AVX2FP8_MOE = _class("AVX2FP8_MOE", "FP8", quantizes_bf16=False)
AMXFP8PerChannel_MOE = _class("AMXFP8PerChannel_MOE", "FP8_PERCHANNEL", quantizes_bf16=False)
AMXInt4_KGroup_MOE = _class("AMXInt4_KGroup_MOE", "RAWINT4", quantizes_bf16=False)
AVX2RawInt4_MOE = _class("AVX2RawInt4_MOE", "RAWINT4", quantizes_bf16=False)
AVXVNNI256RawInt4_MOE = _class("AVXVNNI256RawInt4_MOE", "RAWINT4", quantizes_bf16=False)
AVX2GPTQInt4_MOE = _class("AVX2GPTQInt4_MOE", "GPTQ_INT4", quantizes_bf16=False)
AVXVNNI256GPTQInt4_MOE = _class("AVXVNNI256GPTQInt4_MOE", "GPTQ_INT4", quantizes_bf16=False)
AVXVNNI256GPTQInt4Packed_MOE = _class(
    "AVXVNNI256GPTQInt4Packed_MOE", "GPTQ_INT4", quantizes_bf16=False
)
AMXFP4_KGroup_MOE = _class("AMXFP4_KGroup_MOE", "MXFP4", quantizes_bf16=False)
AVX2MXFP4_MOE = _class("AVX2MXFP4_MOE", "MXFP4", quantizes_bf16=False)
AMXMXFP8_KGroup_MOE = _class("AMXMXFP8_KGroup_MOE", "MXFP8", quantizes_bf16=False)
AVX2MXFP8_MOE = _class("AVX2MXFP8_MOE", "MXFP8", quantizes_bf16=False)
MOE = _class("MOE", "LLAMAFILE", "gguf", quantizes_bf16=False)

__all__ = [
    "MOEConfig",
    "AMXInt8_MOE",
    "AMXInt4_MOE",
    "AMXBF16_MOE",
    "AVX2BF16_MOE",
    "AMXFP8_MOE",
    "AVX2FP8_MOE",
    "AMXFP8PerChannel_MOE",
    "AMXInt4_KGroup_MOE",
    "AVX2RawInt4_MOE",
    "AVXVNNI256RawInt4_MOE",
    "AVX2GPTQInt4_MOE",
    "AVXVNNI256GPTQInt4_MOE",
    "AVXVNNI256GPTQInt4Packed_MOE",
    "AMXFP4_KGroup_MOE",
    "AVX2MXFP4_MOE",
    "AMXMXFP8_KGroup_MOE",
    "AVX2MXFP8_MOE",
    "MOE",
]
