"""Backend wrapper classes (the original's ``kt_kernel.utils`` names)."""

from .loader import GGUFLoader, SafeTensorLoader
from .native import AMXMoEWrapper, LlamafileMoEWrapper, NativeMoEWrapper

__all__ = [
    "AMXMoEWrapper",
    "GGUFLoader",
    "LlamafileMoEWrapper",
    "NativeMoEWrapper",
    "SafeTensorLoader",
]
