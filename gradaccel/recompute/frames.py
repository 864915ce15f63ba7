"""The state of one checkpointed forward call until its backward is done: a *frame*.

A frame's pack hook decides, for the k-th tensor autograd saves, whether it stays (kept),
leaves (dropped: rebuilt by replay) or goes to host memory (offloaded); its unpack hook hands
each one back in backward. ``TraceFrame`` is the first call of a signature, which records
the trace; ``OffloadFrame`` (gradaccel/recompute/offload_frame.py) adds host memory. See
gradaccel/recompute/checkpoint.py for the whole.
"""

import contextlib

import torch
import torch.utils.checkpoint as _tc
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from gradaccel.recompute import engine
from gradaccel.recompute.context import autocast_as, autocast_off, rng_restored
from gradaccel.recompute.formulas import strays
from gradaccel.recompute.plan import Plan, _view, make_plan, rebuildable
from gradaccel.recompute.roles import Source
from gradaccel.recompute.split_off import active
from gradaccel.recompute.storage import lazy_bits, storage_key
from gradaccel.recompute.trace import Graph, Recorder, same_meta


class Saved:
    """A saved tensor the frame keeps, with the version autograd would check it against: the
    pack hooks stand in for autograd's saved variables, and so for its in-place check."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        # Detached if it requires grad (else a cycle through its grad_fn); else the object itself, as
        # torch hands it back: a frozen nn.Parameter keeps its class and attributes, and `is` holds.
        self.tensor = t.detach() if t.requires_grad else t
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{self.tensor.type()} {list(self.tensor.shape)}] is at version "
                f"{self.tensor._version}; expected version {self.version} instead (gradaccel.checkpoint)")
        return self.tensor


class ByReference:
    """A saved tensor on a storage the region read from outside (a parameter), under an engine that
    releases parameters (gradaccel/recompute/engine.py): kept as where it lies, not as the tensor,
    so that it never pins the gathered storage; unpack views the tensor as it is then (the engine
    has gathered the module's parameters for its backward)."""

    __slots__ = ("ref", "size", "stride", "offset", "dtype", "version")

    def __init__(self, leaf, t: torch.Tensor, pack):
        self.ref, self.version = leaf.at, leaf.at()._version
        self.size, self.stride, self.offset, self.dtype = pack.size, pack.stride, pack.offset, pack.dtype

    def unpack(self) -> torch.Tensor:
        base = self.ref()
        if base is None:
            raise RuntimeError("gradaccel.checkpoint: a tensor the region read from outside its arguments was freed "
                               "before backward; pass it to the region as an argument.")
        if base._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{base.type()} {list(base.shape)}] is at version {base._version}; expected version "
                f"{self.version} instead (gradaccel.checkpoint)")
        return _view(base, self.size, self.stride, self.offset, self.dtype)


def _by_reference(graph, sid: int, t: torch.Tensor):
    """The leaf of storage ``sid`` where ``t``, saved on it, is kept by reference (an engine
    releases the parameters, and the region read this storage from outside), else None."""
    external = graph.storages[sid].external
    if external is None or external.source is not Source.OBJ:
        return None
    base = external.at()
    return external if base is not None and storage_key(base) == storage_key(t) else None


class Frame:
    """Keeps or drops each saved tensor as the plan says; rebuilds dropped ones on unpack.

    A call that strays from the trace (it saves another tensor than the trace did at some point,
    or more or fewer) keeps everything it saves from there on. What it dropped before cannot
    always be replayed then: the replay may read a tensor the trace kept later, which this call
    never handed over. Given ``call`` (the region and its arguments), such a call is recomputed
    whole in backward instead, as torch.utils.checkpoint does (:meth:`_recompute`).
    """

    def __init__(self, plan: Plan | None, flat: list, rng, call: tuple | None = None):
        self.plan = plan  # None for the traced call: its plan is made at its end
        self.leaves: dict = {}  # storage -> the tensor replay starts from
        self.pack_leaves: dict = {}  # pack index -> storage: kept tensors replay reads
        self.out_leaves: list = []  # (storage, output index): outputs replay reads
        if plan is not None:
            self.leaves = {sid: flat[i] for sid, i in plan.arg_leaves}
            self.pack_leaves = {**plan.out_pack_leaves, **plan.pack_leaves}
            self.out_leaves = plan.out_leaves
        self.rng = rng
        # (function, args, kwargs) while the forward runs; after it, only where the call strayed.
        self.call = call
        self.k = 0
        self.diverged = False
        self.strayed_at = None  # the first pack index where the call strayed from the trace
        self.divergence = ""  # that difference, for the warning
        self.results = None
        self.versions: dict = {}
        self.finished = False  # False while the forward runs: a backward then is inside it
        self.gather = False  # an engine's hook runs at the first unpack of backward (see _engine_replay)
        self.engine = engine.active()  # saved parameters are kept by reference (ByReference)

    def opaque(self, forward, args, kwargs, name):
        """Runs a split-off submodule (see gradaccel/recompute/checkpoint.py) as its own checkpoint."""
        return _tc.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    @torch._disable_dynamo  # a hook: when a compiled block saves tensors, dynamo must not trace it
    def pack(self, t: torch.Tensor):
        k = self.k
        self.k = k + 1
        plan = self.plan
        if self.diverged or k >= len(plan.keep) or not self._as_traced(t, plan.graph.packs[k]):
            return self._diverge(t)
        if plan.keep[k]:
            if self.engine:
                leaf = _by_reference(plan.graph, plan.graph.packs[k].storage, t)
                if leaf is not None:
                    return ByReference(leaf, t, plan.graph.packs[k])
            kept = Saved(t)
            sid = self.pack_leaves.get(k)
            if sid is not None:
                self.leaves[sid] = kept.tensor
            return kept
        return k

    def _as_traced(self, t: torch.Tensor, pack) -> bool:
        """Whether ``t`` is the tensor the trace saw saved at this point. A trace sized from
        formulas also predicts its strides and offset: a call that strays from them diverges."""
        if self.plan.graph.sized and strays(t, pack):
            return False
        return same_meta(t, pack)

    def _diverge(self, t: torch.Tensor):
        if not self.diverged:  # not what the trace saw: keep it, and everything after it
            k = self.k - 1  # t's pack index
            self.diverged, self.strayed_at = True, k
            graph = self.plan.graph
            self.divergence = f"saved tensor {k} is {_made_by(t)}, where the trace saved " + \
                (_traced(graph, graph.packs[k]) if k < len(graph.packs) else f"only {k} tensors")
        return Saved(t)

    @torch._disable_dynamo
    def unpack(self, x):
        if self.gather:
            self._engine_replay()
        if type(x) is not int:
            return x.unpack()
        if self.diverged and self.call is not None and self.finished:
            return self._recompute(x)
        if not self.finished:  # a backward inside the forward (a gradient penalty): only what it needs
            try:
                return self.plan.replay(self.leaves, self.rng, packs=[x])[x]
            except KeyError:
                raise RuntimeError(
                    "gradaccel.checkpoint: a backward inside the region's forward needs a tensor the region "
                    "has not made yet; use budget=0 (torch.utils.checkpoint) for this region.") from None
        if self.results is None or x not in self.results:
            self._check_leaves()
            self.results = self.plan.replay(self.leaves, self.rng)
        return self.results.pop(x)

    def _engine_replay(self) -> None:
        """Under an engine that releases the parameters (gradaccel/recompute/engine.py): at the
        first unpack of backward, on every rank alike, its hook gathers what the region read from
        outside, the whole replay runs (if the plan drops anything; for a call that strayed from
        its trace, the whole region again), and the hook releases."""
        self.gather = False
        with engine.replaying(self._outside()):
            if self.diverged and self.call is not None:
                self._rerun()
            elif self.plan.dropped_packs:
                self._replay_all()

    def _replay_all(self) -> None:
        self._check_leaves()
        self.results = self.plan.replay(self.leaves, self.rng)

    def _outside(self) -> list:
        """The tensors the region read from outside its arguments (its parameters), alive."""
        found = (s.external.at() for s in self.plan.graph.storages
                 if s.external is not None and s.external.source is Source.OBJ)
        return [t for t in found if t is not None]

    def _check_leaves(self) -> None:
        """Replay reads the arguments and outputs as they are now: refuse, loudly, what would
        rebuild the dropped tensors wrongly."""
        self._check_versions()
        missing = [sid for sid, src in self.plan.leaf_sources.items()
                   if sid not in self.leaves and src.source is not Source.OBJ]
        if missing:
            raise RuntimeError(
                "gradaccel.checkpoint: the region saved different tensors than when it was traced for the same "
                "input signature, so what it dropped cannot be rebuilt. Make the region's behaviour depend only on "
                "its arguments and on the modules it is called on (pass the region as a module, or as a method of "
                "one, so that their training flags and frozen parameters are part of the signature), or call "
                "gradaccel.reset_plans() after changing it.")

    def _check_versions(self) -> None:
        for t, version in self.versions.values():
            if t._version != version:
                raise RuntimeError(
                    "gradaccel.checkpoint: an argument or output of the region was modified in place after "
                    "its forward, and backward recomputes from it; modify a clone instead (or use budget=0, "
                    "which recomputes from the arguments only).")

    def finish(self, out) -> bool:
        """Attaches the outputs replay reads; False when the call diverged from the trace."""
        if not self.diverged and self.k != len(self.plan.keep):  # fewer saved tensors than traced
            self.diverged, self.strayed_at = True, self.k
            self.divergence = (f"it saved {self.k} tensors, where the trace saved {len(self.plan.keep)} "
                               f"(the next: {_traced(self.plan.graph, self.plan.graph.packs[self.k])})")
        self.finished = True
        self.gather = self.engine
        if self.diverged and self.call is not None:  # recomputed whole, from its arguments: no leaves
            self.leaves = {}
            self.versions = {id(t): (t, t._version) for t in tree_flatten(self.call[1:])[0]
                             if isinstance(t, torch.Tensor)}
            return False
        self.call = None  # replay rebuilds what it dropped, from the leaves only
        if self.out_leaves:
            outs = tree_flatten(out)[0]
            for sid, j in self.out_leaves:
                self.leaves[sid] = outs[j].detach()
        self.versions = _versions(self.leaves, self.plan)
        return not self.diverged

    def _recompute(self, x: int) -> torch.Tensor:
        """A saved tensor of a call that strayed from its trace: the region runs again whole,
        on the same arguments, generator state and autocast, and hands back the tensors this
        call dropped (those before it strayed). ``x``: the pack index. The one way to rebuild
        them that does not trust the trace."""
        if self.results is None or x not in self.results:
            self._rerun()
        return self.results.pop(x)

    def _rerun(self) -> None:
        """Runs the region again whole, on the arguments it was called with, and keeps what this
        call handed to autograd as pack indices: the packs before it strayed that the plan does
        not keep (dropped or offloaded)."""
        self._check_versions()
        fn, args, kwargs = self.call
        wanted = {k for k in range(self.strayed_at) if not self.plan.keep[k]}
        results, count = {}, [0]

        def pack(t):
            k = count[0]
            count[0] = k + 1
            if k in wanted:
                results[k] = t.detach() if t.requires_grad else t
            return k

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(rng_restored(self.rng))
            stack.enter_context(autocast_off(self.plan.graph.devices))
            stack.enter_context(autocast_as(self.plan.graph.autocast))
            stack.enter_context(saved_tensors_hooks(pack, _never))
            stack.enter_context(active(self))  # split-off submodules run as in the forward
            fn(*args, **kwargs)
        self.results = results


class TraceFrame(Frame):
    """The first call: records the graph and drops every saved tensor that can be rebuilt."""

    def __init__(self, graph: Graph, flat: list, rng):
        super().__init__(None, flat, rng)
        self.graph = graph
        self.flat = flat
        self.dropped: set = set()
        self.kept: dict = {}
        self.recorder = Recorder(graph)
        self.taken_back: dict = {}  # output storage -> Saved, as the forward left it
        self.so_far = (None, None, None)  # (trace size, plan, leaves) for a backward inside the forward

    def opaque(self, forward, args, kwargs, name):
        """A split-off submodule: run as its own checkpoint, unrecorded, and noted as one op."""
        was, self.recorder.paused = self.recorder.paused, True
        self.graph.in_opaque += 1
        try:
            out = _tc.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        finally:
            self.recorder.paused = was
            self.graph.in_opaque -= 1
        if not was:
            self.graph.record_opaque(name, args, kwargs, out)
        return out

    @torch._disable_dynamo  # a hook: when a compiled block saves tensors, dynamo must not trace it
    def pack(self, t: torch.Tensor):
        was, self.recorder.paused = self.recorder.paused, True  # our own detach() is not part of the region
        try:
            graph = self.graph
            sid = graph.add_pack(t)
            k = len(graph.packs) - 1
            if not lazy_bits(t) and graph.storages[sid].creator >= 0 and rebuildable(graph, sid):
                self.dropped.add(sid)
                return k
            leaf = _by_reference(graph, sid, t) if self.engine else None
            if leaf is not None:
                return ByReference(leaf, t, graph.packs[k])
            saved = Saved(t)
            self.kept[k] = saved.tensor
            return saved
        finally:
            self.recorder.paused = was

    def finish(self, out) -> bool:
        graph = self.graph
        graph.finish(out)
        self.strong = graph.take_externals()  # this call's backward may read them
        self.plan = make_plan(graph, 0, dropped=self.dropped)
        outs = tree_flatten(out)[0]
        self.leaves.update(self._held_leaves(self.plan))
        # Taken back from the outputs: what was dropped before it was one, and what replay reads that
        # autograd saved. Other outputs are not held (the caller may drop them: y = x + f(x)).
        wanted = self.dropped | {s for s, src in self.plan.leaf_sources.items() if src.source is Source.OUT}
        for s, j in graph.outputs.items():
            if s in wanted:
                self.leaves.setdefault(s, outs[j].detach())
                self.taken_back[s] = Saved(self.leaves[s])  # checked at unpack, like a kept tensor
        self.versions = _versions(self.leaves, self.plan)
        self.flat = self.kept = None
        self.finished = True
        self.gather = self.engine
        return True

    def _held_leaves(self, plan: Plan) -> dict:
        """The leaves of ``plan`` this call holds already: its arguments and the tensors it kept."""
        return {sid: self.flat[src.at] if src.source is Source.ARG else self.kept[src.at]
                for sid, src in plan.leaf_sources.items() if src.source in (Source.ARG, Source.PACK)}

    def _unpack_in_forward(self, x):
        """A backward inside the forward (a gradient penalty, a nested checkpoint's early
        stop): rebuilds the dropped tensors saved so far from a plan of the trace so far."""
        was, self.recorder.paused = self.recorder.paused, True  # the replay is not part of the region
        try:
            key = (len(self.graph.ops), len(self.graph.packs))  # the trace so far
            if self.so_far[0] != key:
                plan = make_plan(self.graph, 0, dropped=self.dropped)
                self.so_far = (key, plan, self._held_leaves(plan))
            _, plan, leaves = self.so_far
            t = plan.replay(leaves, self.rng, packs=[x])[x]
        finally:
            self.recorder.paused = was
        # What the backward computes from it reads the saved tensor's storage, not a new one.
        sid = self.graph.packs[x].storage
        self.graph.alias(t, sid)
        return t

    @torch._disable_dynamo
    def unpack(self, x):
        if not self.finished:
            return x.unpack() if type(x) is not int else self._unpack_in_forward(x)
        if self.gather:
            self._engine_replay()
        if type(x) is int and self.plan.keep[x]:  # an output's storage, dropped before it was one
            p = self.graph.packs[x]
            saved = self.taken_back.get(p.storage)
            base = saved.unpack() if saved is not None else self.leaves[p.storage]
            return _view(base, p.size, p.stride, p.offset, p.dtype)
        return super().unpack(x)


def _never(k):
    raise RuntimeError("gradaccel.checkpoint: a tensor saved while recomputing a region was unpacked (a "
                       "backward inside the region's forward, during a recompute), which is not supported")


def _made_by(t: torch.Tensor) -> str:
    """A saved tensor in words: its shape, dtype and the autograd node that made it."""
    node = "an input" if t.grad_fn is None else type(t.grad_fn).__name__
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} from {node}"


def _traced(graph: Graph, pack) -> str:
    """A traced saved tensor in words: its shape, dtype and the op (and submodule) that made it."""
    creator = graph.storages[pack.storage].creator
    op = graph.ops[creator] if creator >= 0 else None
    where = "an input" if op is None else str(op.func) + (f" ({op.module})" if op.module else "")
    return f"{tuple(pack.size)} {str(pack.dtype).removeprefix('torch.')} from {where}"


def _versions(leaves: dict, plan: Plan) -> dict:
    """storage -> (tensor, version at the end of the forward) for the arguments and outputs
    that replay reads."""
    return {sid: (leaves[sid], leaves[sid]._version) for sid, src in plan.leaf_sources.items()
            if src.source in (Source.ARG, Source.OUT) and sid in leaves}
