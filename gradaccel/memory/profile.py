"""Profiles one training micro-step of a model on fake tensors, block by block.

The model is copied onto ``FakeTensorMode`` (no memory, no arithmetic: a full-size model at
full sequence length costs only the Python of its ops) and run twice:

1. a *trace pass*: the first block of each kind (blocks with the same class, parameter shapes
   and plain settings: ``gradaccel.recompute.structure.module_kind``) runs under gradaccel's own
   tracer (``gradaccel.recompute.region.trace_call``), the very trace
   ``gradaccel.checkpoint`` takes on its first call, so that the planner can be asked what a
   block keeps and recomputes at any budget;
2. a *skeleton pass*: forward and backward with every block at the keep-nothing plan, under
   :class:`~gradaccel.memory.LiveBytes`, which records the live bytes at the start and peak of
   each phase (each block's forward, the head and loss, each block's backward, the rest).

A block's own memory under plan ``p`` is measured by running it alone, forward then backward,
with ``p``'s frame (:meth:`Profile.block_peak`); this module also holds the plans a block may
run (:meth:`Profile.options`). :meth:`Profile.predict` composes the peak of a step with any
per-block plans from those measurements (gradaccel/memory/step_peak.py, which ``Profile``
inherits); see its docstring.
"""

import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from gradaccel.recompute.blocks import find_blocks, model_class
from gradaccel.recompute.own_forward import own_forward
from gradaccel.recompute.region import trace_call
from gradaccel.recompute.state import STATE
from gradaccel.recompute.structure import module_kind
from gradaccel.memory.counter import LiveBytes, Trajectory
# A block kind, its plans, and running a block under one (gradaccel/memory/kinds.py); plans other
# than a budget (PARTS, "tiles:n", "nested:n", "sliced:n") are named in gradaccel/memory/parts.py.
from gradaccel.memory.kinds import KEEP_ALL, Kind, Point, cheaper_front, fake_copy, fake_mode, run_plan  # noqa: F401
from gradaccel.memory.parts import (PARTS, check_structure, has_parts, has_tiles, is_nested, is_sliced, nested,  # noqa: F401
                                    set_parts, slice_counts, sliced, sliced_count, slices_of, tiles)
from gradaccel.memory.step_peak import StepPeak
from gradaccel.memory.sliced import kv_flops, why_not
from gradaccel.recompute.block_plan import plan_of

RUNS = [0]  # fake-tensor profiles made in this process (one per Profile): what planning costs


def profile_runs() -> int:
    """How many fake-tensor profiles (:class:`Profile`, one per input shape) this process made."""
    return RUNS[0]


class Profile(StepPeak):
    """Everything :meth:`predict` needs about one micro-step of ``model`` at one input shape.

    Args:
        model: the model (real or fake tensors; it is copied onto fake tensors, not run).
        step: ``step(model, batch) -> loss``; the micro-step's forward up to the loss.
        batch: the micro-batch (real or fake tensors), passed to ``step``.
        grad_hooks: free each parameter's ``.grad`` as soon as it is accumulated, as
            ``FusedAccumOptimizer``'s fold does (True), or leave grads to pile up (False).
        prepare: called with the fake model before it runs (to switch a mode on, say).
        trajectories: also record the live bytes after every op of each run (the skeleton's in
            ``events``, each block run's in ``Kind.events``), for gradaccel/memory/lengths.py.
    """

    pinned_inputs = frozenset()  # blocks whose input is a leaf that requires grad (run_parked keeps it)

    def __init__(self, model: nn.Module, step, batch, grad_hooks: bool = True, skeleton: bool = True,
                 prepare=None, trajectories: bool = False):
        RUNS[0] += 1
        self.trajectories = trajectories
        first = next(iter(model.parameters()), None)
        if first is not None and hasattr(first, "fake_mode"):  # already fake: ours, used as is
            self.mode, self.model = first.fake_mode, model
        else:
            self.mode = fake_mode()
            self.model = fake_copy(model, self.mode)
        self.model.train()
        if prepare is not None:
            prepare(self.model)
        with self.mode:
            self.batch = tree_map(lambda t: self.mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
        self.step = step
        self.blocks = find_blocks(self.model)
        if not self.blocks:
            raise ValueError(f"no repeated blocks found in {type(model).__name__}")
        for b in self.blocks:
            if getattr(b, "gradient_checkpointing", False):
                b.gradient_checkpointing = False  # the profile runs blocks itself
            if plan_of(b) is not None:
                set_parts(b, False)  # the plan the model runs now (a fit's, say) is not what is profiled
        kinds: dict = {}
        for i, b in enumerate(self.blocks):
            key = module_kind(b)
            kinds.setdefault(key, Kind(key, [])).blocks.append(i)
        self.kinds = list(kinds.values())
        self.kind_of = {i: k for k in self.kinds for i in k.blocks}
        self.grad_hooks = grad_hooks
        self._terms = {}
        self._trace_pass()
        if skeleton:
            self._skeleton_pass()

    def _live_bytes(self):
        if not self.trajectories:
            return LiveBytes()
        return Trajectory()

    # -- running blocks our way ------------------------------------------------------------
    def _install(self, runner):
        originals = []
        for i, b in enumerate(self.blocks):
            originals.append(b.__dict__.get("forward"))
            b.forward = functools.partial(runner, i, _plain_forward(b))
        return originals

    def _uninstall(self, originals):
        for b, f in zip(self.blocks, originals):
            if f is None:
                del b.forward
            else:
                b.forward = f

    def _trace_block(self, i, forward, *args, **kwargs):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_leaf and args[0].requires_grad:
            self.pinned_inputs = self.pinned_inputs | {i}  # autograd holds it: never parked
        flat, _ = tree_flatten((args, kwargs))
        grads = tuple(t.requires_grad for t in flat if isinstance(t, torch.Tensor))
        kind = self.kind_of[i]
        if kind.graph is not None and kind.input_grads != grads:
            # Same block, other inputs (the first block behind frozen embeddings): its own kind.
            kind.blocks.remove(i)
            kind = next((k for k in self.kinds if k.key == (kind.key, grads)), None)
            if kind is None:
                kind = Kind((self.kind_of[i].key, grads), [])
                self.kinds.append(kind)
            kind.blocks.append(i)
            self.kind_of[i] = kind
        if kind.graph is not None:
            return run_plan(forward, kind.zero.plan, args, kwargs)
        kind.input_grads = grads
        graph, out = trace_call(forward, args, kwargs)
        kind.graph, kind.args, kind.kwargs = graph, args, kwargs
        kind.forward_cost = sum(op.cost for op in graph.ops)
        kind.zero = kind.plan_at(1)
        if i == self._last_new:
            raise _Traced  # every kind is traced: the rest of the forward is not needed
        return out

    def _trace_pass(self):
        # The last block whose kind is not decided by an earlier one (inputs needing grad can
        # still split the first block off, so at least the second block is traced).
        self._last_new = max(max(k.blocks[0] for k in self.kinds), min(1, len(self.blocks) - 1))
        originals = self._install(self._trace_block)
        try:
            with self.mode, torch.enable_grad():
                self.step(self.model, self.batch)
        except _Traced:
            pass
        finally:
            self._uninstall(originals)
        for k in self.kinds:
            if k.graph is None:
                raise ValueError("a block was never called by the step")
            if k.graph.dynamic:
                raise ValueError("a block reads tensor data into Python (.item(), data-dependent shapes): "
                                 "its plan cannot be profiled; use a fixed budget fraction for it")
        # Inputs of each kind, detached: a standalone run must not backpropagate into the trace pass.
        for k in self.kinds:
            k.args, k.kwargs = tree_map(_fresh_leaf, (k.args, k.kwargs))

    def _skeleton_block(self, i, forward, *args, **kwargs):
        live = self.live
        live.set_phase(("fwd", i))
        self.pre[i] = live.live
        out = run_plan(forward, self.plans[i], args, kwargs)
        self.held[i] = live.live
        first = tree_flatten(out)[0][0]
        if first.requires_grad:
            first.register_hook(functools.partial(_mark, live, ("bwd", i)))
        if i == 0:
            x = tree_flatten((args, kwargs))[0][0]
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(functools.partial(_mark, live, "tail"))
        if i == len(self.blocks) - 1:
            live.set_phase("head")
        return out

    def _skeleton_pass(self):
        n = len(self.blocks)
        self.plans = [self.kind_of[i].zero.plan for i in range(n)]
        self.pre, self.held = [0] * n, [0] * n
        self.live = self._live_bytes()
        originals = self._install(self._skeleton_block)
        handles = self._grad_hooks()
        try:
            with self.mode, torch.enable_grad(), self.live:
                self.live.set_phase("pre")
                loss = self.step(self.model, self.batch)
                self.end_forward = self.live.live  # blocks' and outside activations, logits and loss
                loss.backward()
                del loss
        finally:
            self._uninstall(originals)
            for h in handles:
                h.remove()
        self.phases = dict(self.live.phases)
        if self.trajectories:
            self.events = (self.live.trace, self.live.marks)

    def _grad_hooks(self):
        if not self.grad_hooks:
            return []
        seen, handles = set(), []
        for p in self.model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                handles.append(p.register_post_accumulate_grad_hook(_drop_grad))
        return handles

    # -- one block alone ---------------------------------------------------------------------
    def block_peak(self, kind: Kind, point) -> int:
        """Peak live bytes of one block of ``kind`` run alone, forward then backward, under
        ``point``'s plan (or KEEP_ALL), counted from before its forward (its inputs excluded)."""
        key = KEEP_ALL if point == KEEP_ALL else point.key
        if key not in kind._peaks:
            block = self.blocks[kind.blocks[0]]
            forward = _plain_forward(block)
            plan = KEEP_ALL if point == KEEP_ALL else point.plan
            live, handles = self._live_bytes(), self._grad_hooks()
            previous, STATE.previous_offload = STATE.previous_offload, None  # run alone: no neighbour
            # Gradients are made afresh, as in a step: none left from the last run to add into.
            leaves = list(block.parameters()) + [t for t in tree_flatten((kind.args, kind.kwargs))[0]
                                                 if isinstance(t, torch.Tensor)]
            for t in leaves:
                t.grad = None
            try:
                with self.mode, torch.enable_grad(), live:
                    out = run_plan(forward, plan, kind.args, kind.kwargs)
                    forward_peak, held, forward_end = live.peak, live.live, len(getattr(live, "trace", ()))
                    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                    del out, outs
            finally:
                STATE.previous_offload = previous
                for h in handles:
                    h.remove()
                for t in leaves:
                    t.grad = None
            kind._peaks[key] = (forward_peak, live.peak, held)
            if self.trajectories:
                kind.events[key] = (live.trace, forward_end)
        return kind._peaks[key][1]

    def uncheckpointed(self, kind: Kind) -> Point:
        """The point of a block of ``kind`` run without a checkpoint (KEEP_ALL): it recomputes
        nothing, and keeps what autograd saves (keep-least's kept bytes, plus the difference of
        the two runs' bytes held after forward)."""
        zero = kind.zero
        self.block_peak(kind, zero)
        self.block_peak(kind, KEEP_ALL)
        return Point(KEEP_ALL, zero.kept + kind._peaks[KEEP_ALL][2] - kind._peaks[zero.key][2], 0.0, 0, 0, KEEP_ALL)

    def block_forward_peak(self, kind: Kind, point) -> int:
        """As :meth:`block_peak`, the peak during the forward alone."""
        self.block_peak(kind, point)
        return kind._peaks[KEEP_ALL if point == KEEP_ALL else point.key][0]

    def block_peak_estimate(self, kind: Kind, point: Point) -> int:
        """:meth:`block_peak` without running the block: the larger of replay's moment (what is
        kept plus what replay makes, offset as measured at the keep-nothing plan) and the
        backward with every activation present (measured with nothing dropped). Parts plans
        are run (once per kind)."""
        if slices_of(point.plan) > 0:
            return self.block_peak(kind, point)
        zero = kind.zero
        at_zero = self.block_peak(kind, zero)
        full = self.block_peak(kind, KEEP_ALL)
        offset = at_zero - zero.kept - zero.replay_bytes if at_zero > full else 0
        # Offloaded tensors come back to the device for the backward, as replayed ones do.
        return max(point.kept + point.replay_bytes + point.host + offset, full)

    def options(self, kind: Kind, offload: bool = False) -> list:
        """The plans a block of ``kind`` may run: its frontier (``offload``: with offload), and
        where the block has parts, the parts plans. Those recompute what keep-least does and
        keep more (their parts' inputs), but rebuild one part at a time, so backward's working
        set is smaller: a filter on kept bytes would drop them, the split on the peak's terms
        (gradaccel/memory/split.py) weighs them. Tiles are offered at a few slice counts
        (``parts.slice_counts`` of the block's tokens: the slice is the split's choice); a sliced
        plan, where the block is one that runs sliced (gradaccel/memory/sliced.py: the whole
        block a slice at a time, K/V whole, holding its input alone), at the finest of them."""
        if kind._options is None:
            block = self.blocks[kind.blocks[0]]
            plans = [PARTS] if has_parts(block) else []
            counts = slice_counts(_tokens(kind))
            if plans:
                with self.mode:  # which norms may run inside their consumer (parts.check_structure)
                    check_structure(block, kind.args, kind.kwargs)
                tile_counts = counts if has_tiles(block) else []
                plans += [tiles(n) for n in tile_counts]
                # Parts inside a keep-nothing checkpoint: at the finest slices (their peak is the
                # least; what they hold is the block's input alone, whatever the slices).
                plans.append(nested(max(tile_counts, default=1)))
            if why_not(block) is None and counts:
                # At the finest slices only: sliced plans recompute the same at any count (as
                # priced), so the split would take the lowest peak, the finest, anyway.
                plans.append(sliced(sliced_count(_tokens(kind))))
            kind._options = [self.piece_point(kind, plan) for plan in plans]
        return (kind.offload_frontier if offload else kind.frontier) + kind._options

    def piece_point(self, kind: Kind, plan: str) -> Point:
        """The point of a plan that runs a block of ``kind`` in pieces (``"parts"``,
        ``"tiles:n"``, ``"nested:n"``, ``"sliced:n"``): its block run alone for its peaks, what it
        holds after forward beyond keep-nothing's, and what it recomputes (:meth:`_recompute_of`)."""
        zero = kind.zero
        self.block_peak(kind, zero)
        point = Point(plan, zero.kept, *self._recompute_of(kind, plan), 0, plan)
        self.block_peak(kind, point)
        point.kept += kind._peaks[plan][2] - kind._peaks[zero.key][2]  # held after forward
        return point

    def _recompute_of(self, kind: Kind, plan) -> tuple:
        """(cost, FLOPs) a plan that runs the block in pieces recomputes: keep-nothing's (every op
        once); a nested plan twice that (the block in backward, and its parts once more in it); a
        sliced plan keep-nothing's plus the K/V projections once more (priced at keep-nothing's
        cost per FLOP). The pieces' own traces are not priced: a sliced causal attention counts
        fewer FLOPs than the whole one by torch's formula, which does not discount the mask."""
        zero = kind.zero
        if is_nested(plan):
            return 2 * zero.cost, 2 * zero.flops
        if is_sliced(plan):
            if kind._kv_flops is None:
                x, cos_sin = kind.args[0], kind.kwargs["position_embeddings"]
                with self.mode:
                    kind._kv_flops = kv_flops(self.blocks[kind.blocks[0]], x, *cos_sin)
            per_flop = zero.cost / zero.flops if zero.flops else 0.0
            return zero.cost + per_flop * kind._kv_flops, zero.flops + kind._kv_flops
        return zero.cost, zero.flops


class _Traced(Exception):
    pass


def _tokens(kind) -> int:
    """The sequence length of a block's first tensor input ``(batch, tokens, width)``."""
    x = next(t for t in tree_flatten((kind.args, kind.kwargs))[0] if isinstance(t, torch.Tensor))
    return x.shape[-2] if x.dim() >= 2 else 1


def _plain_forward(block):
    """The block's forward, without checkpoint_blocks' wrapper (the profile runs plans itself)."""
    return own_forward(block, model_class(block))


def _fresh_leaf(t):
    if isinstance(t, torch.Tensor):
        return t.detach().requires_grad_(t.requires_grad)
    return t


def _mark(live, label, grad):
    live.set_phase(label)


def _drop_grad(p):
    p.grad = None
