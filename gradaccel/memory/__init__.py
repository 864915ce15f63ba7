"""Memory planning: how much a training step holds, and the plan that fits a target.

- counter.py: every count of bytes: :class:`LiveBytes` (live tensor bytes and their peak),
  the activation bytes a forward holds for backward, and the step's fixed parts (weights,
  gradients, optimizer state).
- profile.py: one training micro-step profiled on fake tensors, block by block; step_peak.py:
  the step's peak composed from it under any per-block plans; kinds.py: a block kind, its plans,
  and running a block under one.
- split.py: one target split across blocks, least recompute whose predicted peak fits.
- parts.py, sliced.py and chunked_loss.py: the plans below the per-block floor (a block's parts
  as their own checkpoints; the whole block a slice of the sequence at a time, K/V whole; the
  causal-LM loss in chunks). parts.py names every plan that is not a byte budget.
- parking.py: which blocks' inputs wait on the host, within the host memory there is.
- target.py: ``checkpoint_blocks(model, memory=...)``; fit.py (``gradaccel.fit``): micro-batch,
  accumulation and every block's plan for a memory target, with presets.py and fixed_parts.py;
  fit_table.py (how a fit reads) and fit_cli.py (``python -m gradaccel.fit``); zero3.py: both
  under DeepSpeed ZeRO-3 (a rank's share, what is gathered at once).
"""

from gradaccel.memory.counter import LiveBytes, format_bytes, measured_peak, optimizer_state_bytes, parse_bytes, storage_bytes

__all__ = ["LiveBytes", "format_bytes", "measured_peak", "optimizer_state_bytes", "parse_bytes", "storage_bytes"]
