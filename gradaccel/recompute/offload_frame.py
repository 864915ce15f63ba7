"""The frame of a call whose plan sends some saved storages to host memory (``offload=True``).

:class:`OffloadFrame` is gradaccel/recompute/frames.py's :class:`~gradaccel.recompute.frames.Frame`
plus host memory: each offloaded storage goes to an ActivationStore (gradaccel/recompute/offload.py)
at its first pack and comes back in backward, prefetched with the next region's. :func:`store_for`
gives the store every region with one ``host_budget`` shares.
"""

import collections
import weakref

import torch

from gradaccel.recompute.frames import Frame
from gradaccel.recompute.plan import Plan, _view
from gradaccel.recompute.roles import Source
from gradaccel.recompute.state import STATE


class OffloadFrame(Frame):
    """A frame whose plan sends some saved storages to host memory through an ActivationStore.

    The whole storage goes, once, at its first pack (views share it). If the store refuses
    (``host_budget`` exhausted), the frame falls back to the plan without offload: it
    recomputes instead, so the device budget still holds.
    """

    def __init__(self, plan: Plan, flat: list, rng, store, call: tuple | None = None):
        super().__init__(plan, flat, rng, call)
        fallback = plan.fallback
        self.leaves.update({sid: flat[i] for sid, i in fallback.arg_leaves})
        self.pack_leaves = {**fallback.pack_leaves, **plan.pack_leaves}
        self.out_leaves = fallback.out_leaves + plan.out_leaves
        self.store = store
        self.handles: dict = {}  # storage -> store handle
        self.fetched: dict = {}  # storage -> the storage back on its device (bytes), while a pack on it waits
        # Offloaded storage -> its saved tensors not unpacked yet: once none waits, the fetched copy
        # goes (backward holds the tensors it unpacked; the handle stays, for a backward that runs again).
        self.waiting = collections.Counter(p.storage for p in plan.graph.packs if p.storage in plan.offloaded)
        self.fell_back = False
        self.prefetched = False
        weakref.finalize(self, _release, store, self.handles)
        self.previous, STATE.previous_offload = STATE.previous_offload, weakref.ref(self)

    @torch._disable_dynamo  # a hook: when a compiled block saves tensors, dynamo must not trace it
    def pack(self, t: torch.Tensor):
        k = self.k
        x = super().pack(t)
        if type(x) is int and not self.fell_back:
            sid = self.plan.graph.packs[k].storage
            if sid in self.plan.offloaded and sid not in self.handles:
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                handle = self.store.offload(whole)
                if handle is None:
                    self.fell_back = True
                else:
                    self.handles[sid] = handle
        return x

    def finish(self, out) -> bool:
        same = super().finish(out)
        if self.call is not None:  # strayed: recomputed whole, offloaded tensors too
            _release(self.store, self.handles)
        return same

    @torch._disable_dynamo
    def unpack(self, x):
        if self.gather:
            self._engine_replay()
        if type(x) is not int or self.call is not None and self.finished:
            return super().unpack(x)  # kept, or a call recomputed whole
        if not self.prefetched:  # this region's copies, and the next region's (backward order)
            self.prefetched = True
            previous = self.previous() if self.previous is not None else None
            for frame in (self, previous):
                for handle in (frame.handles.values() if frame is not None else ()):
                    self.store.prefetch(handle)
        if self.fell_back:
            if self.results is None or x not in self.results:
                self.results = self.plan.fallback.replay(self.leaves, self.rng)
            return self.results.pop(x)
        p = self.plan.graph.packs[x]
        if p.storage in self.plan.offloaded:
            t = _view(self._fetch(p.storage), p.size, p.stride, p.offset, p.dtype)
            self.waiting[p.storage] -= 1
            self._let_go(p.storage)
            return t
        if self.results is not None and x in self.results:
            return super().unpack(x)
        # The replay starts from offloaded storages too: fetched for it, and let go after it.
        starts = [sid for sid, src in self.plan.leaf_sources.items() if src.source is Source.OFFLOAD]
        for sid in starts:
            self.leaves[sid] = self._fetch(sid)
        try:
            return super().unpack(x)
        finally:
            for sid in starts:
                del self.leaves[sid]
                self._let_go(sid)

    def _replay_all(self) -> None:
        """The whole replay, for an engine's hook: from the fallback plan, or from the offloaded
        storages fetched for it (as unpack does for the first dropped tensor)."""
        if self.fell_back:
            self.results = self.plan.fallback.replay(self.leaves, self.rng)
            return
        starts = [sid for sid, src in self.plan.leaf_sources.items() if src.source is Source.OFFLOAD]
        for sid in starts:
            self.leaves[sid] = self._fetch(sid)
        try:
            super()._replay_all()
        finally:
            for sid in starts:
                del self.leaves[sid]
                self._let_go(sid)

    def _fetch(self, sid: int) -> torch.Tensor:
        if sid not in self.fetched:
            self.fetched[sid] = self.store.fetch(self.handles[sid])
        return self.fetched[sid]

    def _let_go(self, sid: int) -> None:
        if self.waiting[sid] <= 0:
            self.fetched.pop(sid, None)


def store_for(host_budget):
    """The ActivationStore of every region that offloads with this ``host_budget``."""
    from gradaccel.recompute.offload import ActivationStore

    if host_budget not in STATE.stores:
        STATE.stores[host_budget] = ActivationStore(host_budget)
    return STATE.stores[host_budget]


def _release(store, handles: dict) -> None:
    for handle in handles.values():
        store.release(handle)
    handles.clear()
