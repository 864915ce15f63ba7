"""``gradaccel.hf.enable`` and ``gradaccel.hf.disable``: the public path of the Hugging Face entry
point (gradaccel/integrations/hf.py, which documents it)."""

from gradaccel.integrations.hf import disable, enable

__all__ = ["enable", "disable"]
