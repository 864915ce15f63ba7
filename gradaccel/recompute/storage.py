"""Storages, defined once: who is which storage (views share one) and whether its bits are the
tensor's values. The trace, the frames, the plan key, offload and ``gradaccel.memory.counter`` use these."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (its StorageImpl's address), shared by every view of it.
    Valid only while the storage lives: a freed address is reused (see :class:`StorageMap`)."""
    return t.untyped_storage()._cdata


class StorageMap:
    """Live storages -> a value each. Storages are held weakly, and an entry whose storage died
    is no hit: its address may now belong to another storage."""

    def __init__(self):
        self._entries: dict[int, tuple[StorageWeakRef, object]] = {}

    def get(self, t: torch.Tensor, default=None):
        hit = self._entries.get(storage_key(t))
        return default if hit is None or hit[0].expired() else hit[1]

    def set(self, t: torch.Tensor, value) -> None:
        st = t.untyped_storage()
        self._entries[st._cdata] = (StorageWeakRef(st), value)

    def items(self):
        """(storage key, value) of every storage still alive."""
        return [(key, value) for key, (ref, value) in self._entries.items() if not ref.expired()]

    def live(self):
        """(storage key, the storage as it is now, value) of every storage still alive: a storage
        resized since it was set (FSDP2 frees a gathered parameter that way) shows its size now."""
        return [(key, torch.UntypedStorage._new_with_weak_ptr(ref.cdata), value)
                for key, (ref, value) in self._entries.items() if not ref.expired()]

    def clear(self) -> None:
        self._entries.clear()


def lazy_bits(x) -> bool:
    """A tensor whose conjugation or negation is a flag, not yet in its storage's bits: whatever
    works on storages (replay, copies to host) must take its values, not its storage."""
    return isinstance(x, torch.Tensor) and (x.is_conj() or x.is_neg())
