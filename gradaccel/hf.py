"""``gradaccel.hf.enable``: the public path of the Hugging Face entry point
(gradaccel/integrations/hf.py, which documents it)."""

from gradaccel.integrations.hf import enable

__all__ = ["enable"]
