"""Integrations: one call puts gradaccel under a user's model or training framework.

- blocks.py: ``gradaccel.checkpoint_blocks``, every repeated block of a model checkpointed, at a
  per-block budget or one memory target for the step.
- hf.py: ``gradaccel.hf.enable`` (and ``disable``), a Hugging Face ``Trainer`` (TRL's too) or
  accelerate loop on gradaccel's accumulation, clipping and checkpoint; one backend per engine
  (hf_backend.py: one process, refused; hf_dist.py: DDP; hf_deepspeed.py: DeepSpeed ZeRO 0-3,
  with hf_zero3.py for ZeRO-3's sharded parameters).
"""

from gradaccel.integrations.blocks import checkpoint_blocks

__all__ = ["checkpoint_blocks"]
