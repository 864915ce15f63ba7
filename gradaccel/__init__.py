"""gradaccel: exact fused gradient accumulation and budgeted selective recompute for PyTorch.

- :func:`checkpoint`, :func:`checkpoint_sequential`: drop-ins for ``torch.utils.checkpoint``
  that keep the activations worth keeping under a memory ``budget``; :func:`checkpoint_blocks`
  applies it to every transformer block of a model; :func:`plan_report` shows the plans.
- :class:`FusedAccumOptimizer`: wraps any ``torch.optim`` optimizer so that gradients are
  accumulated exactly in one fp32 buffer while the training loop stays the stock one.
- :func:`gradaccel.hf.enable`: one line puts a Hugging Face Trainer (TRL's too) or an
  accelerate loop on gradaccel's accumulation, clipping and checkpoint.
- :func:`gradaccel.fit.fit` (``python -m gradaccel.fit``): micro-batch, accumulation and every
  block's plan for a memory target, predicted on fake tensors before the first step.
  ``checkpoint_blocks(model, memory="6GiB")`` plans one step to a memory target, below the
  per-block floor too (:mod:`gradaccel.memory.target`).
- :mod:`gradaccel.ops`: the fused accumulate kernels (C++ on CPU, Triton on CUDA).

The package reads as its architecture, one subpackage per feature, dependencies running one
way: ``integrations`` (checkpoint_blocks, Hugging Face) -> ``memory`` (planning: the fit, the
``memory=`` target, the counter) -> ``recompute`` (checkpoint) and ``accumulate`` (the
optimizer) -> ``ops`` (kernels).
"""

from gradaccel.version import __version__
from gradaccel import hf, ops
from gradaccel.accumulate import FusedAccumOptimizer, WindowScheduler
from gradaccel.integrations import checkpoint_blocks
from gradaccel.recompute import checkpoint, checkpoint_sequential, plan_report, plan_rows, reset_plans

__all__ = [
    "__version__", "hf", "ops", "checkpoint", "checkpoint_sequential", "checkpoint_blocks", "plan_report",
    "plan_rows", "reset_plans", "FusedAccumOptimizer", "WindowScheduler",
]
