"""Exact activation-memory measurement on any device, by storage (as bench/checkpoint.py uses it)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradaccel.recompute.storage import StorageMap, storage_key


class StorageLog(TorchDispatchMode):
    """Logs every storage created while active (weakly; views and in-place results excluded).

    It is a dispatch mode: code whose behaviour depends on whether one is active (torch's
    selective checkpoint replays ops by index) must see one in its backward too; running that
    backward under another ``StorageLog`` keeps the two passes alike.
    """

    def __init__(self):
        super().__init__()
        self.created = StorageMap()  # storage -> its bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: only new storages count.
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                if storage_key(t) not in inputs and self.created.get(t) is None:
                    self.created.set(t, t.untyped_storage().nbytes())
        return out


def held_activation_bytes(fn, *args, **kwargs):
    """Runs ``fn(*args, **kwargs)`` and measures what its forward leaves alive for backward.

    Counts the bytes of storages created inside the forward that are still alive after it,
    each storage once however many views share it, excluding the storages of the outputs
    (the caller holds those) and anything that existed before (parameters, inputs).

    Returns:
        ``(output, bytes)``.
    """
    existing = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    log = StorageLog()
    with log:
        out = fn(*args, **kwargs)
    outputs = {storage_key(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    held = sum(nbytes for key, nbytes in log.created.items() if key not in outputs and key not in existing)
    return out, held
