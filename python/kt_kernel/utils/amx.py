"""The original's ``kt_kernel.utils.amx`` module path: the AMX and native-format wrappers."""

from .native import AMXMoEWrapper, NativeMoEWrapper

__all__ = ["AMXMoEWrapper", "NativeMoEWrapper"]
