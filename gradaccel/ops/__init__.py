"""Kernels: the fused gradient-accumulation ops and everything that runs them.

- :func:`scale_accumulate_` (public): ``acc += grad.float() * scale`` in place; ``fold_`` and
  ``finalize_`` serve ``FusedAccumOptimizer``. Registered as ``torch.ops.gradaccel.<name>``
  (gradaccel/ops/accumulate.py), with a C++ kernel on CPU and a Triton kernel on CUDA.
- ``gradaccel/ops/triton/``: the Triton kernels and their launchers.
- ``gradaccel/ops/csrc/``: the C++ sources of the extension (``gradaccel_C``: the CPU
  kernels, the recompute planner, the activation store), loaded by gradaccel/ops/extension.py.
"""

from gradaccel.ops.accumulate import finalize_, fold_, scale_accumulate_
from gradaccel.ops.wgrad import embedding_accumulate_, wgrad_accumulate_

__all__ = ["scale_accumulate_", "fold_", "finalize_", "wgrad_accumulate_", "embedding_accumulate_"]
