"""gradaccel: exact fused gradient accumulation and budgeted selective recompute for PyTorch."""

from gradaccel.version import __version__
from gradaccel import ops
from gradaccel.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["__version__", "ops", "checkpoint", "checkpoint_sequential"]
