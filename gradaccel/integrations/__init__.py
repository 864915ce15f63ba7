"""Integrations: one call puts gradaccel under a user's model or training framework.

- blocks.py: ``gradaccel.checkpoint_blocks``, every repeated block of a model checkpointed, at a
  per-block budget or one memory target for the step.
- hf.py: ``gradaccel.hf.enable``, a Hugging Face ``Trainer`` (TRL's too) or accelerate loop on
  gradaccel's accumulation, clipping and checkpoint.
"""

from gradaccel.integrations.blocks import checkpoint_blocks

__all__ = ["checkpoint_blocks"]
