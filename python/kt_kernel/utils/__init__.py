"""Backend wrapper classes (the original's ``kt_kernel.utils`` names)."""

from .native import AMXMoEWrapper, LlamafileMoEWrapper, NativeMoEWrapper

__all__ = ["AMXMoEWrapper", "LlamafileMoEWrapper", "NativeMoEWrapper"]
