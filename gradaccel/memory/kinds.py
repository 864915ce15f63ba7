"""A block kind and its plans, run on fake tensors: what :mod:`gradaccel.memory.profile` measures.

Blocks with equal kinds (``gradaccel.recompute.structure.module_kind``: classes, parameter shapes,
plain settings) trace alike,
so one block of each kind is traced (the very trace ``gradaccel.checkpoint`` takes) and stands for
all of them. A :class:`Kind` holds that trace and asks ``gradaccel.checkpoint``'s own planner for
its plans at any budget (its frontier, with offload or without); :func:`run_plan` runs a block
under one plan, whatever it is:

- a byte budget (a :class:`Point`'s plan): the block's saved tensors kept or dropped as the plan
  says, through a frame that matches them to the traced ones by position (``_SharedFrame``);
- ``KEEP_ALL``: no checkpoint;
- a plan that runs the block in pieces (gradaccel/memory/parts.py names them: ``"parts"``,
  ``"tiles:n"``, ``"nested:n"``, ``"sliced:n"``): the block's parts as checkpoints of their own,
  or the whole block a slice at a time (gradaccel/memory/sliced.py).

Offloaded plans run with a store that keeps host copies off the fake device (``_FakeStore``).
"""

import copy
import dataclasses
import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint as _tc
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from gradaccel.recompute.frames import Frame
from gradaccel.recompute.offload_frame import OffloadFrame
from gradaccel.recompute.plan import Planner, capture_rng, copy_device, offload_cost_per_byte
from gradaccel.recompute.region import plan_graph
from gradaccel.recompute.trace import Graph
from gradaccel.memory import zero3
from gradaccel.memory.parts import is_nested, is_sliced, set_parts, slices_of
from gradaccel.memory.sliced import run_sliced

__all__ = ["KEEP_ALL", "Kind", "Point", "cheaper_front", "fake_copy", "fake_mode", "run_plan"]

KEEP_ALL = "all"  # the plan of a block run without checkpointing


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_copy(model: nn.Module, mode) -> nn.Module:
    """``model`` with every parameter and buffer replaced by a fake tensor of the same shape,
    dtype and ``requires_grad`` (shared weights stay shared); ``model`` itself is untouched. A
    parameter DeepSpeed ZeRO-3 shards is copied at its whole shape, and the copy runs without
    ZeRO-3's module hooks (gradaccel/memory/zero3.py)."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            shape = zero3.whole_shape(t)
            if shape == t.shape:
                f = mode.from_tensor(t.detach())
            else:
                with mode:
                    f = torch.empty(shape, dtype=t.dtype, device=t.device)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    fake = copy.deepcopy(model, memo)
    zero3.without_engine_hooks(fake)
    return fake


@dataclasses.dataclass
class Point:
    """One plan of a block kind: the budget that gives it and what it keeps and costs."""

    budget: int
    kept: int
    cost: float
    flops: int
    replay_bytes: int  # what replay holds at once (Plan.replay_peak: it lets go of each storage after its last read)
    plan: object
    host: int = 0  # bytes sent to host memory (checkpoint(..., offload=True)); not in ``kept``
    copy: float = 0.0  # the part of ``cost`` that is those bytes' copies, priced at the measured copy speed

    @property
    def key(self):
        return ("offload", self.budget) if self.host else self.budget


@dataclasses.dataclass
class Kind:
    key: tuple
    blocks: list  # indices into Profile.blocks
    graph: Graph = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    zero: Point = None
    forward_cost: float = 0.0  # the planner's cost of one forward of the block
    input_grads: tuple = ()  # which tensor inputs require grad, in the traced call
    _peaks: dict = dataclasses.field(default_factory=dict)
    _options: list = None  # the parts plans (Profile.options)
    _kv_flops: int = None  # FLOPs of the block's K/V projections (a sliced plan makes them once more)
    events: dict = dataclasses.field(default_factory=dict)  # point key -> (live bytes after each op, forward's end)

    @functools.cached_property
    def frontier(self) -> list:
        """Plans from keeping least to keeping all, each cheaper to recompute than the last."""
        return _points(self)

    @functools.cached_property
    def planner(self) -> Planner:
        """The block's graph in the C++ planner's terms, made once for all its plans."""
        return Planner(self.graph)

    def plan_at(self, budget: int) -> Point:
        """The plan ``gradaccel.checkpoint`` makes at ``budget`` bytes (its own planning code)."""
        plan = plan_graph(self.graph, budget, planner=self.planner, name="profile")
        return Point(budget, plan.kept_bytes, plan.cost, plan.recompute_flops, plan.replay_peak, plan)

    def offload_at(self, budget: int) -> Point:
        """The plan ``gradaccel.checkpoint(..., offload=True)`` makes at ``budget`` bytes: what the
        budget leaves out goes to host memory where the copy costs less than its recompute (the
        checkpoint's own planner, at this machine's measured copy cost). ``cost`` includes the
        copies; ``kept`` is what stays on the device."""
        plan = plan_graph(self.graph, budget, offload=True, name="profile")
        if not plan.offloaded:
            return self.plan_at(budget)
        copy = offload_cost_per_byte(copy_device(self.graph), self.graph.cost) * plan.offloaded_bytes
        return Point(budget, plan.kept_bytes, plan.cost + copy, plan.recompute_flops, plan.replay_peak, plan,
                     host=plan.offloaded_bytes, copy=copy)

    @functools.cached_property
    def offload_frontier(self) -> list:
        """As :attr:`frontier`, with offload."""
        return _points(self, at=self.offload_at)


def _points(kind: Kind, steps: int = 24, at=None) -> list:
    total = kind.graph.activation_bytes
    seen, out = set(), []
    for j in range(steps + 1):
        p = (at or kind.plan_at)(max(1, total * j // steps))
        if p.kept not in seen:
            seen.add(p.kept)
            out.append(p)
    out.sort(key=lambda p: p.kept)
    return cheaper_front(out)


def cheaper_front(points: list) -> list:
    """``points`` (plans sorted by the bytes they keep) less those that keep more and cost no less."""
    front = []
    for p in points:
        if not front or p.cost < front[-1].cost:
            front.append(p)
    return front


class _SharedFrame(Frame):
    """A frame for a plan traced on another block of the same kind. The k-th saved tensor is
    kept or dropped as the plan says; only the autograd node that made it may differ (the first
    block's input comes from the embedding, the others' from a residual add)."""

    def _as_traced(self, t: torch.Tensor, pack) -> bool:
        return t.dtype == pack.dtype and tuple(t.shape) == pack.size

    def _diverge(self, t: torch.Tensor):
        raise RuntimeError("gradaccel.fit: blocks of one kind saved different tensors; profile them apart")


class _SharedOffloadFrame(_SharedFrame, OffloadFrame):
    pass


class _FakeStore:
    """An ActivationStore for fake tensors, with the real one's device memory: an offloaded
    storage leaves the device (its host copy is not device memory), and ``prefetch``/``fetch``
    bring it back as a new device tensor, held until fetched and released."""

    def __init__(self):
        self.entries, self.staged = {}, {}

    def offload(self, whole):
        handle = len(self.entries)
        self.entries[handle] = (whole.numel(), whole.device)
        return handle

    def prefetch(self, handle):
        if handle not in self.staged and handle in self.entries:
            n, device = self.entries[handle]
            self.staged[handle] = torch.empty(n, dtype=torch.uint8, device=device)

    def fetch(self, handle):
        self.prefetch(handle)
        return self.staged.pop(handle)

    def release(self, handle):
        self.entries.pop(handle, None)
        self.staged.pop(handle, None)


def run_plan(forward, plan, args, kwargs):
    """``forward(*args, **kwargs)`` of a block (its plain forward, bound) under ``plan``."""
    if plan == KEEP_ALL:
        return forward(*args, **kwargs)
    if is_sliced(plan):
        return run_sliced(forward.__self__, slices_of(plan), forward, args, kwargs)
    if slices_of(plan) > 0:
        block = forward.__self__

        def parts(*a, **k):  # the children's checkpoints rerun their plain forwards
            set_parts(block, True, slices_of(plan))
            try:
                return forward(*a, **k)
            finally:
                set_parts(block, False)

        # A nested plan's block is one keep-nothing checkpoint around its parts (budget 0 is
        # torch.utils.checkpoint): its recompute in backward runs the parts again.
        if is_nested(plan):
            return _tc.checkpoint(parts, *args, use_reentrant=False, **kwargs)
        return parts(*args, **kwargs)
    flat, _ = tree_flatten((args, kwargs))
    rng = capture_rng(plan.graph.devices) if plan.needs_rng else None
    if plan.offloaded:
        frame = _SharedOffloadFrame(plan, flat, rng, _FakeStore())
        with saved_tensors_hooks(frame.pack, frame.unpack):
            out = forward(*args, **kwargs)
        frame.finish(out)
        return out
    frame = _SharedFrame(plan, flat, rng)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        out = forward(*args, **kwargs)
    frame.finish(out)
    return out
