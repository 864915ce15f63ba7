"""Exact gradient accumulation: ``FusedAccumOptimizer`` and its window.

- optimizer.py: ``FusedAccumOptimizer``, a ``torch.optim.Optimizer`` wrapping any optimizer.
- slots.py: the window gradient, one flat fp32 buffer (laid out by flat.py) that each
  parameter's gradient folds into as backward makes it (the ``gradaccel.ops`` kernels).
- wgrad.py: ``fuse_wgrad``: nn.Linear / nn.Embedding weight gradients added by their GEMM
  straight into the buffer (``gradaccel.ops.wgrad_accumulate_``), never made as tensors.
- window.py: what the window's sum is divided by, and ``WindowScheduler``.
- sync.py (replicated ranks: one all-reduce per window) and sharded.py (FSDP2 ``fully_shard``).
- state_dict.py: save and resume, mid-window included.
- framework.py: what a framework's own accumulation loop calls (Trainer, accelerate: ``gradaccel.hf``).
"""

from gradaccel.accumulate.optimizer import FusedAccumOptimizer, WindowScheduler

__all__ = ["FusedAccumOptimizer", "WindowScheduler"]
