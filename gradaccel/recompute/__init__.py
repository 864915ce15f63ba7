"""Selective recompute: activation checkpointing that keeps what fits a memory budget.

- checkpoint.py: ``checkpoint`` and ``checkpoint_sequential`` (public through ``gradaccel``),
  report.py: ``plan_report`` and ``plan_rows``; a region (region.py: its plan and later calls) is
  traced once (trace.py), planned by the C++ planner (plan.py, cost.py, roles.py), and run by
  frames (frames.py; offload_frame.py with host memory) that keep, drop or offload (offload.py)
  each saved tensor.
- Plans across sizes: structure.py (one trace per structure, a module's kind), symbolic.py (the
  region run on symbolic sizes), formulas.py (the trace as formulas of the input sizes).
- blocks.py: finds a model's repeated blocks and wraps each in a checkpoint (the mechanism
  under ``gradaccel.checkpoint_blocks``); own_forward.py (a module's own forward, bound, also
  while torch.compile traces).
- storage.py (who is which storage), context.py (the generator state and autocast a replay
  runs under), split_off.py (data-dependent submodules), state.py (the module-level caches that
  ``reset_plans`` clears), engine.py (hooks for an engine that releases the parameters a region
  reads: DeepSpeed ZeRO-3).
"""

from gradaccel.recompute.checkpoint import OpCost, checkpoint, checkpoint_sequential, plan_report, plan_rows, reset_plans

__all__ = ["checkpoint", "checkpoint_sequential", "plan_report", "plan_rows", "reset_plans", "OpCost"]
