"""The original's ``kt_kernel.utils.llamafile`` module path: the GGUF wrapper."""

from .native import LlamafileMoEWrapper

__all__ = ["LlamafileMoEWrapper"]
