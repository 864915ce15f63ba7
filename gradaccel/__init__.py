"""gradaccel: exact fused gradient accumulation and budgeted selective recompute for PyTorch."""

from gradaccel.version import __version__

__all__ = ["__version__"]
