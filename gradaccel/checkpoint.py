"""PLACEHOLDER: gradaccel.checkpoint with the final signature, delegating to torch for now.

Being replaced by the budgeted selective-recompute implementation (issue 4).
"""

import torch.utils.checkpoint as _tc


def checkpoint(function, *args, budget=None, preserve_rng_state=True, use_reentrant=None, **kwargs):
    """Drop-in for ``torch.utils.checkpoint.checkpoint`` (placeholder: full recompute)."""
    return _tc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def checkpoint_sequential(functions, segments, input, budget=None, use_reentrant=None, preserve_rng_state=True):
    """Same signature and results as ``torch.utils.checkpoint.checkpoint_sequential``."""
    return _tc.checkpoint_sequential(functions, segments, input, use_reentrant=False, preserve_rng_state=preserve_rng_state)
