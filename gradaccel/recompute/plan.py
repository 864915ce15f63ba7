"""Turns a traced region into a plan: what each saved tensor does (keep or drop) and the replay
program that rebuilds the dropped ones in backward.

The choice itself is made by the C++ planner (gradaccel/ops/csrc/planner.cpp); this module builds its arrays
from the trace, and runs the replay: only the ops the dropped tensors need, in their original
order, under ``no_grad`` (autograd re-attaches unpacked tensors to the forward graph, so even
double backward needs no recorded history), with autocast off (the trace is below autocast:
its casts are ops of their own; an op from outside aten runs under the autocast it ran under,
for the aten ops inside it) and the generator restored to its state at region entry.
"""

import copy
import dataclasses
import functools
import math

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradaccel.ops import extension as _ext
from gradaccel.recompute.context import autocast_as, autocast_off, rng_restored
from gradaccel.recompute.context import capture_rng, rng_state_bytes  # noqa: F401 (checkpoint.py, memory/profile.py)
from gradaccel.recompute.roles import Leaf, Read, Source
from gradaccel.recompute.cost import FLOPS_PER_BYTE, OFFLOAD_PROBE_BYTES, OpCost, price
from gradaccel.recompute.trace import Graph, Ref


@dataclasses.dataclass
class Plan:
    """The keep/drop decision for one traced region, and how to undo each drop."""

    graph: Graph
    keep: list  # per pack: True = keep (the tensor stays alive), False = drop and replay
    steps: list  # op ids to replay, in order
    uses_rng: bool
    kept_bytes: int  # activation bytes this plan holds after forward
    total_bytes: int  # activation bytes the region holds without checkpointing
    budget_bytes: int
    recompute_flops: int
    cost: float
    exact: bool
    fits: bool
    offloaded: set = dataclasses.field(default_factory=set)  # storages sent to host memory
    offloaded_bytes: int = 0
    fallback: "Plan | None" = None  # the plan without offload, if host memory runs out

    # -- how replay finds its arguments (made when first read: the memory planner makes dozens of
    # plans per length to compare their bytes and costs, and runs none of them) ----------------
    @functools.cached_property
    def reads(self) -> dict:
        """(op id, leaf index) -> Read: where a replayed op's tensor argument comes from."""
        steps, values, reads = set(self.steps), self.graph.values, {}
        for op_id in self.steps:
            for i, x in enumerate(self.graph.ops[op_id].leaves):
                if isinstance(x, Ref):
                    reads[(op_id, i)] = Read.META if x.meta_only else \
                        Read.REPLAY if values[x.value][1] in steps else Read.LEAF
        return reads

    @functools.cached_property
    def leaf_sources(self) -> dict:
        """storage -> Leaf: where a call finds each storage replay starts from."""
        graph = self.graph
        needed = sorted({graph.ops[op_id].leaves[i].storage for (op_id, i), where in self.reads.items()
                         if where is Read.LEAF})
        first_pack = {}
        for k, p in enumerate(graph.packs):
            first_pack.setdefault(p.storage, k)
        sources = {}
        for s in needed:
            if s in graph.outputs:
                sources[s] = Leaf(Source.OUT, graph.outputs[s])
            elif graph.storages[s].creator < 0:
                sources[s] = graph.storages[s].external
            elif s in self.offloaded:
                sources[s] = Leaf(Source.OFFLOAD, s)
            else:
                sources[s] = Leaf(Source.PACK, first_pack[s])
        return sources

    # -- what the forward needs (computed once per plan, read by every call's frame) ---------
    @functools.cached_property
    def arg_leaves(self) -> list[tuple[int, int]]:
        return [(sid, src.at) for sid, src in self.leaf_sources.items() if src.source is Source.ARG]

    @functools.cached_property
    def pack_leaves(self) -> dict[int, int]:
        return {src.at: sid for sid, src in self.leaf_sources.items() if src.source is Source.PACK}

    @functools.cached_property
    def out_leaves(self) -> list[tuple[int, int]]:
        return [(sid, src.at) for sid, src in self.leaf_sources.items() if src.source is Source.OUT]

    def twin(self, graph: Graph) -> "Plan":
        """This plan for ``graph``: the same trace but for the tensors it reads from outside
        its arguments (another layer of a model at the same sizes; see :class:`Shared`). The
        choice, the replay program and how replay finds its arguments are this plan's."""
        sources = self.leaf_sources  # worked out here first, so that every twin shares the rest
        twin = copy.copy(self)  # with what this plan worked out so far (reads, leaves by source)
        twin.graph = graph
        twin.__dict__["leaf_sources"] = {s: graph.storages[s].external if src.source is Source.OBJ else src
                                         for s, src in sources.items()}
        return twin

    @property
    def needs_rng(self) -> bool:
        """Whether a call must save the generator state: this plan, or its fallback, replays
        random ops."""
        return self.uses_rng or (self.fallback is not None and self.fallback.uses_rng)

    @functools.cached_property
    def draws(self) -> bool:
        """Whether the region draws random numbers that a recompute must draw again (with
        ``preserve_rng_state``): a call then saves the generator state even where this plan
        replays no random op, for a full recompute if the call strays from the trace
        (gradaccel/recompute/frames.py), as torch.utils.checkpoint saves it on every call."""
        return self.graph.preserve_rng_state and any(op.random and not _draws_nothing(op) for op in self.graph.ops)

    def externals_alive(self) -> bool:
        """False once a tensor read from outside the arguments has died: the region has
        changed (e.g. a closure captured a new tensor) and must be traced again."""
        return all(src.at() is not None for src in self.leaf_sources.values() if src.source is Source.OBJ)

    @functools.cached_property
    def out_pack_leaves(self) -> dict[int, int]:
        """Outputs replay reads, by the first pack of their storage: a backward inside the
        forward (before the outputs are returned) finds them there."""
        first = {}
        for k, p in enumerate(self.graph.packs):
            first.setdefault(p.storage, k)
        return {first[sid]: sid for sid, src in self.leaf_sources.items() if src.source is Source.OUT and sid in first}

    @functools.cached_property
    def _produced(self) -> dict:
        """op id -> the values it makes (new storages and in-place writes)."""
        produced: dict = {}
        for vid, (_, op_id) in enumerate(self.graph.values):
            produced.setdefault(op_id, []).append(vid)
        return produced

    def steps_for(self, packs) -> list:
        """The replay steps that the saved tensors ``packs`` (pack indices) need, in order: a
        backward inside the forward rebuilds only those, from what the forward has made so far."""
        graph, produced = self.graph, self._produced
        need = {graph.packs[k].value for k in packs}
        chosen = []
        for op_id in reversed(self.steps):
            if any(v in need for v in produced.get(op_id, ())):
                chosen.append(op_id)
                need.update(graph.ops[op_id].reads)
        return chosen[::-1]

    @functools.cached_property
    def dropped_packs(self) -> list:
        """Pack indices a full replay rebuilds: those neither kept nor offloaded."""
        return [k for k, p in enumerate(self.graph.packs) if not self.keep[k] and p.storage not in self.offloaded]

    def releases(self, steps: list, packs: list) -> list:
        """Per step of ``steps``: the storages replay lets go of once it has run (their last
        read among ``steps``), all but those of the saved tensors ``packs``, which backward
        holds until autograd unpacks them. A replay that held all it made until it returned
        peaked at every temporary of the region at once: up to 2.2x torch.utils.checkpoint's
        step peak on a small Llama block with adapters (bench/replay_peak.py)."""
        ops, last, made = self.graph.ops, {}, set()
        for j, op_id in enumerate(steps):
            for x in ops[op_id].leaves:
                if isinstance(x, Ref) and not x.meta_only:  # a meta-only read gets a stand-in, not the storage
                    last[x.storage] = j
            for sid, _ in ops[op_id].new_storages:
                made.add(sid)
                last[sid] = j  # made and never read: let go at once
        needed = {self.graph.packs[k].storage for k in packs}
        out = [[] for _ in steps]
        for sid, j in last.items():
            if sid in made and sid not in needed:
                out[j].append(sid)
        return out

    @functools.cached_property
    def _full_releases(self) -> list:
        return self.releases(self.steps, self.dropped_packs)

    @functools.cached_property
    def replay_peak(self) -> int:
        """The most bytes a full replay holds at once, of the storages it makes (what is kept,
        the arguments and outputs are held anyway): a sweep over its steps, each counted with
        its outputs made and the storages it read not yet let go, as
        gradaccel.memory.LiveBytes counts a real run. Of the storages it makes, those of the
        dropped saved tensors stay after it returns: their bytes are
        :attr:`replay_held`."""
        storages, ops = self.graph.storages, self.graph.ops
        live = peak = 0
        for op_id, gone in zip(self.steps, self._full_releases):
            op = ops[op_id]
            live += sum(storages[s].nbytes for s, _ in op.new_storages)
            # Stand-ins for metadata-only reads (dropout's empty_like(x)) live for the op alone.
            peak = max(peak, live + sum(_extent(x) for x in op.leaves if isinstance(x, Ref) and x.meta_only))
            live -= sum(storages[s].nbytes for s in gone)
        return peak

    @functools.cached_property
    def replay_held(self) -> int:
        """Bytes of the storages a full replay makes and hands to backward (the dropped saved
        tensors'), each held until autograd has unpacked every tensor saved on it."""
        made = {s for op_id in self.steps for s, _ in self.graph.ops[op_id].new_storages}
        return sum(self.graph.storages[s].nbytes for s in {self.graph.packs[k].storage for k in self.dropped_packs}
                   if s in made)

    # -- replay ------------------------------------------------------------------------------
    def replay(self, leaves: dict, rng_state, packs=None) -> dict:
        """Rebuilds every dropped saved tensor (or only those in ``packs``, pack indices).
        ``leaves`` maps storage ids to tensors held by the forward (kept tensors, arguments,
        outputs). Returns {pack index: tensor}. A storage it makes lives until its last read
        in the replay, unless a returned tensor is on it (:meth:`releases`)."""
        graph, env = self.graph, {}
        if packs is None:
            steps, packs, releases = self.steps, self.dropped_packs, self._full_releases
        else:
            steps = self.steps_for(packs)
            releases = self.releases(steps, packs)
        for sid, src in self.leaf_sources.items():
            if src.source is Source.OBJ:
                t = src.at()
                if t is None:
                    raise RuntimeError(
                        "gradaccel.checkpoint: a tensor the region read from outside its arguments was freed "
                        "before backward; pass it to the region as an argument.")
                leaves[sid] = t
        with torch.no_grad(), autocast_off(graph.devices), rng_restored(rng_state):
            for op_id, gone in zip(steps, releases):
                op = graph.ops[op_id]
                args = [self._arg(op_id, i, x, env, leaves) for i, x in enumerate(op.leaves)]
                a, kw = tree_unflatten(args, op.spec)
                del args  # the views of its arguments must not outlive the op (nor its outputs, below)
                if op.autocast:  # an op outside aten: its own aten ops are cast as in the forward
                    with autocast_as(op.autocast):
                        out_leaves = tree_flatten(op.func(*a, **kw))[0]
                else:
                    out_leaves = tree_flatten(op.func(*a, **kw))[0]
                del a, kw
                for sid, i in op.new_storages:
                    env[sid] = out_leaves[i]
                del out_leaves
                for sid in gone:
                    del env[sid]
        return {k: _view(env[graph.packs[k].storage], *_geometry(graph.packs[k])) for k in packs
                if not self.keep[k] and graph.packs[k].storage not in self.offloaded}

    def _arg(self, op_id, i, x, env, leaves):
        if not isinstance(x, Ref):
            return x
        where = self.reads[(op_id, i)]
        if where is Read.META:
            return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=x.device)
        base = env[x.storage] if where is Read.REPLAY else leaves[x.storage]
        return _view(base, x.size, x.stride, x.offset, x.dtype)


def _draws_nothing(op) -> bool:
    """A random op at dropout probability 0, such as attention in a model without attention
    dropout: it draws no random numbers (checked on CPU for scaled_dot_product_attention and dropout)."""
    schema = getattr(op.func, "_schema", None)
    if schema is None:
        return False
    args, kwargs = tree_unflatten(op.leaves, op.spec)
    for i, a in enumerate(schema.arguments):
        if a.name in ("dropout_p", "p"):
            p = args[i] if i < len(args) else kwargs.get(a.name, a.default_value if a.has_default_value() else None)
            return isinstance(p, (int, float)) and p == 0
    return False


def _extent(x: Ref) -> int:
    """Bytes of ``torch.empty_strided(x.size, x.stride, dtype=x.dtype)``."""
    if any(n == 0 for n in x.size):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(x.size, x.stride))) * x.dtype.itemsize


def _geometry(p) -> tuple:
    return p.size, p.stride, p.offset, p.dtype


def _view(base: torch.Tensor, size, stride, offset, dtype) -> torch.Tensor:
    """``base``'s storage seen with the given geometry (the same tensor when it already is)."""
    if base.dtype == dtype:
        if base.shape == size and base.stride() == stride and base.storage_offset() == offset:
            return base
        return base.as_strided(size, stride, offset)
    return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)


def copy_device(graph: Graph) -> torch.device:
    """The device whose copies to host memory offload prices: the region's GPU, else the CPU."""
    return next((d for d in graph.devices if d.type == "cuda"), torch.device("cpu"))


def offload_cost_per_byte(device: torch.device, cost="flops") -> float:
    """What sending one byte to host memory and back costs, in the units of op costs under the
    cost model ``cost`` (see :func:`gradaccel.checkpoint`), with copy speeds measured once per
    process (gradaccel.recompute.offload.copy_bandwidth): for ``"measured"``, the round trip's seconds per
    byte; for a callable, its price of a round trip of a MiB (``OpCost`` named
    ``"gradaccel.offload"``), per byte."""
    if callable(cost):
        return price(cost, OpCost("gradaccel.offload", 0, OFFLOAD_PROBE_BYTES, device), None) / OFFLOAD_PROBE_BYTES
    from gradaccel.recompute.offload import copy_bandwidth

    d2h, h2d = copy_bandwidth(device)
    if cost == "measured":
        return 1 / d2h + 1 / h2d
    return _flops_copy_cost(device, d2h, h2d)


@functools.cache
def _flops_copy_cost(device: torch.device, d2h: float, h2d: float) -> float:
    """The round trip under the "flops" model. Op costs count the bytes an op reads and writes at
    the device's memory bandwidth; a copy of n bytes moves 2n there, so a round trip costs
    2 * (bandwidth / d2h + bandwidth / h2d) per byte."""
    if device.type == "cuda":
        x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        y.copy_(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            y.copy_(x)
        end.record()
        end.synchronize()
        local = 5 * x.numel() / (start.elapsed_time(end) / 1e3)
        balance = FLOPS_PER_BYTE["cuda"]
    else:
        local, balance = (d2h + h2d) / 2, FLOPS_PER_BYTE["cpu"]
    return 2 * balance * (local / d2h + local / h2d)


def _problem(graph: Graph, available: list, candidates: list, nbytes: list, values: list):
    """The planner's view of ``graph`` (see gradaccel/ops/csrc/planner.cpp): ``available`` per storage,
    and each candidate storage with its bytes and the value backward needs of it."""
    return _ext.load().PlanProblem(
        [op.cost for op in graph.ops], [op.replayable for op in graph.ops], [op.reads for op in graph.ops],
        [p for _, p in graph.values], [s for s, _ in graph.values],
        [graph.is_leaf_value(v) for v in range(len(graph.values))], available, candidates, nbytes, values,
        [op.random for op in graph.ops])


def rebuildable(graph: Graph, sid: int) -> bool:
    """Whether replay can rebuild storage ``sid`` as it is now from what existed before the
    region. The planner answers it, as it does for every plan; the traced call asks it of each
    tensor autograd saves, as the trace so far stands."""
    available = [s.creator < 0 for s in graph.storages]
    problem = _problem(graph, available, [sid], [0], [graph.current(sid)])
    return problem.replay([False])[0] != math.inf


class Shared:
    """What the first of the callables of a kind planned at one size, for the others: a model's
    layers, called one after another at a new length, have the same sized trace but for their
    own tensors read from outside (gradaccel/recompute/formulas.py), so one planner problem and
    one plan per budget serve them all."""

    MAX_PLANS = 8  # budgets whose plans are kept (budget=0.5 asks one; memory= one per block setting)

    def __init__(self):
        self.arrays = None  # (available, problem, random): see Planner
        self.plans: dict = {}  # (budget bytes, copy cost per byte, rng bytes) -> Plan, without offload


class Planner:
    """A finished graph in the C++ planner's terms (gradaccel/ops/csrc/planner.cpp), made once:
    plans it at any number of budgets. The memory planner asks for dozens of plans of one graph
    at each length; the arrays are built for the first."""

    def __init__(self, graph: Graph):
        storages = graph.storages
        self.graph, self.region = graph, graph.activations
        # A graph sized from formulas carries its size's Shared (its kind's planner arrays and
        # plans). Their traces matched the formulas op for op, and every op of such a trace is
        # priced by formula, so the planner's arrays are the same.
        self.shared = graph.shared
        if self.shared is not None and self.shared.arrays is not None:
            self.available, self.problem, self.random = self.shared.arrays
            return
        packed = {p.storage for p in graph.packs}
        # Outputs count as available only where autograd saves them too (and so holds them): one
        # the caller drops must not be held for replay (y = x + f(x) frees f's output).
        region = set(self.region)
        self.available = [s.creator < 0 or (i in packed and i not in region) for i, s in enumerate(storages)]
        final = {p.storage: storages[p.storage].versions[-1] for p in graph.packs}
        self.problem = _problem(graph, self.available, self.region, [storages[s].nbytes for s in self.region],
                                [final[s] for s in self.region])
        self.random = any(op.random and op.replayable for op in graph.ops)  # a replay may draw random numbers
        if self.shared is not None:
            self.shared.arrays = (self.available, self.problem, self.random)

    def plan(self, budget_bytes: int, offload_cost_per_byte: float | None = None, rng_bytes: int = 0) -> Plan:
        """The plan under ``budget_bytes``: see :func:`make_plan`."""
        key = (budget_bytes, offload_cost_per_byte, rng_bytes)
        shared = self.shared.plans if self.shared is not None else None
        if shared is not None and key in shared:
            return shared[key].twin(self.graph)
        graph, region, available = self.graph, self.region, self.available
        r = self.problem.plan(budget_bytes, rng_bytes=rng_bytes, copy_cost_per_byte=offload_cost_per_byte)
        kept = {s for s, k in zip(region, r.kept) if k}
        offloaded = {s for s, o in zip(region, r.offloaded) if o}
        plan = _build(graph, region, available, kept, set(), r.fallback_steps, r.fallback_cost, r.exact, r.fits,
                      r.budget)
        if not offloaded:
            if shared is not None:
                shared[key] = plan
                while len(shared) > Shared.MAX_PLANS:
                    shared.pop(next(iter(shared)))
            return plan
        with_offload = _build(graph, region, available, kept, offloaded, r.steps, r.cost, r.exact, r.fits, r.budget)
        with_offload.fallback = plan
        return with_offload

    def keeping(self, kept: set) -> Plan:
        """The plan that keeps the region's storages in ``kept`` and replays the others, whatever
        the budget (a plan found at one length, made for another)."""
        cost, steps = self.problem.replay([s in kept for s in self.region])
        return _build(self.graph, self.region, self.available, kept, set(), steps, cost, True, True, 0)


def make_plan(graph: Graph, budget_bytes: int, dropped: set | None = None,
              offload_cost_per_byte: float | None = None, rng_bytes: int = 0) -> Plan:
    """Plans ``graph``, in one call of the C++ planner: under ``budget_bytes``, or (the traced
    call itself) with exactly the storages in ``dropped`` dropped and every other saved storage kept.

    ``rng_bytes``: the generator state a call saves when its replay runs random ops; where the
    plan replays one, it is planned at ``budget_bytes - rng_bytes`` instead (the state is held
    by the region too). With ``offload_cost_per_byte`` (the copy's cost in the units of op costs),
    storages the budget leaves out go to host memory instead of being recomputed where that costs
    less: greedily, the one that saves most replay cost per byte first. The plan then carries a
    ``fallback``: the same plan without offload, for a call whose host memory runs out.

    Raises:
        RuntimeError: ``dropped`` is given and cannot all be rebuilt (the traced call already
            freed them), e.g. because the region wrote in place to a tensor it did not create.
    """
    if dropped is None:
        return Planner(graph).plan(budget_bytes, offload_cost_per_byte, rng_bytes)
    storages = graph.storages
    packed = {p.storage for p in graph.packs}
    candidates = sorted(dropped - set(graph.outputs))
    available = [s.creator < 0 or (i in packed and i not in candidates) for i, s in enumerate(storages)]
    final = {p.storage: storages[p.storage].versions[-1] for p in graph.packs}
    problem = _problem(graph, available, candidates, [storages[s].nbytes for s in candidates],
                       [final[s] for s in candidates])
    # Nothing to choose: every candidate is dropped. (The search would keep a 0-byte one, such as
    # the empty sentinel torch 2.11's checkpoint saves, which the call has freed.)
    cost, steps = problem.replay([False] * len(candidates))
    if cost == math.inf:
        raise RuntimeError(
            "gradaccel.checkpoint: the region writes in place to a tensor it did not create, so what it "
            "saved for backward cannot be recomputed; use budget=0 (torch.utils.checkpoint) for this region.")
    return _build(graph, graph.activations, available, set(), set(), steps, cost, True, True, 0)


def _build(graph, region, available, kept, offloaded, steps, cost, exact, fits, budget) -> Plan:
    """The Plan for a choice: which storages are kept and offloaded, which ops replay (how replay
    finds its arguments is worked out when a call first needs it: :attr:`Plan.reads`)."""
    storages = graph.storages
    on_device = lambda s: available[s] or s in kept  # noqa: E731
    keep = [on_device(p.storage) for p in graph.packs]
    return Plan(graph, keep, steps, any(graph.ops[i].random for i in steps),
                sum(storages[s].nbytes for s in region if on_device(s)), graph.activation_bytes, budget,
                sum(graph.ops[i].flops for i in steps), cost, exact, fits,
                offloaded=offloaded, offloaded_bytes=sum(storages[s].nbytes for s in offloaded))
