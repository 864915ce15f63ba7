"""Turns a traced region into a plan: what each saved tensor does (keep or drop) and the replay
program that rebuilds the dropped ones in backward.

The choice itself is made by the C++ planner (csrc/planner.cpp); this module builds its arrays
from the trace, and runs the replay: only the ops the dropped tensors need, in their original
order, under ``no_grad`` (autograd re-attaches unpacked tensors to the forward graph, so even
double backward needs no recorded history), with autocast off (the trace is below autocast:
its casts are ops of their own) and the generator restored to its state at region entry.
"""

import contextlib
import dataclasses

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradaccel import _ext
from gradaccel._trace import Graph, Ref


@dataclasses.dataclass
class Plan:
    """The keep/drop decision for one traced region, and how to undo each drop."""

    graph: Graph
    keep: list  # per pack: True = keep (the tensor stays alive), False = drop and replay
    steps: list  # op ids to replay, in order
    reads: dict  # (op id, leaf index) -> "leaf" | "replay" | "meta": where a tensor argument comes from
    leaf_sources: dict  # storage id -> ("pack", k) | ("arg", i) | ("obj", weakref) | ("out", j)
    uses_rng: bool
    kept_bytes: int  # activation bytes this plan holds after forward
    total_bytes: int  # activation bytes the region holds without checkpointing
    budget_bytes: int
    recompute_flops: int
    cost: float
    exact: bool
    fits: bool

    # -- what the forward needs ------------------------------------------------------------
    @property
    def arg_leaves(self) -> list[tuple[int, int]]:
        return [(sid, src[1]) for sid, src in self.leaf_sources.items() if src[0] == "arg"]

    @property
    def pack_leaves(self) -> dict[int, int]:
        return {src[1]: sid for sid, src in self.leaf_sources.items() if src[0] == "pack"}

    @property
    def out_leaves(self) -> list[tuple[int, int]]:
        return [(sid, src[1]) for sid, src in self.leaf_sources.items() if src[0] == "out"]

    def externals_alive(self) -> bool:
        """False once a tensor read from outside the arguments has died: the region has
        changed (e.g. a closure captured a new tensor) and must be traced again."""
        return all(src[1]() is not None for src in self.leaf_sources.values() if src[0] == "obj")

    # -- replay ------------------------------------------------------------------------------
    def replay(self, leaves: dict, rng_state) -> dict:
        """Rebuilds every dropped saved tensor. ``leaves`` maps storage ids to tensors held by
        the forward (kept tensors, arguments, outputs). Returns {pack index: tensor}."""
        graph, env = self.graph, {}
        for sid, src in self.leaf_sources.items():
            if src[0] == "obj":
                t = src[1]()
                if t is None:
                    raise RuntimeError(
                        "gradaccel.checkpoint: a tensor the region read from outside its arguments was freed "
                        "before backward; pass it to the region as an argument.")
                leaves[sid] = t
        devices = {s.device for s in graph.storages}
        with torch.no_grad(), _autocast_off(devices), _rng_restored(rng_state):
            for op_id in self.steps:
                op = graph.ops[op_id]
                args = [self._arg(op_id, i, x, env, leaves) for i, x in enumerate(op.leaves)]
                a, kw = tree_unflatten(args, op.spec)
                out_leaves = tree_flatten(op.func(*a, **kw))[0]
                for sid, i in op.new_storages:
                    env[sid] = out_leaves[i]
        return {k: _view(env[p.storage], p.size, p.stride, p.offset, p.dtype)
                for k, p in enumerate(graph.packs) if not self.keep[k]}

    def _arg(self, op_id, i, x, env, leaves):
        if not isinstance(x, Ref):
            return x
        where = self.reads[(op_id, i)]
        if where == "meta":
            return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=x.device)
        base = env[x.storage] if where == "replay" else leaves[x.storage]
        return _view(base, x.size, x.stride, x.offset, x.dtype)


def _view(base: torch.Tensor, size, stride, offset, dtype) -> torch.Tensor:
    """``base``'s storage seen with the given geometry (the same tensor when it already is)."""
    if base.dtype == dtype:
        if base.shape == size and base.stride() == stride and base.storage_offset() == offset:
            return base
        return base.as_strided(size, stride, offset)
    return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)


@contextlib.contextmanager
def _autocast_off(devices):
    with contextlib.ExitStack() as stack:
        for kind in sorted({d.type for d in devices}):
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def capture_rng(devices) -> tuple:
    """Generator states at region entry (CPU, and each CUDA device the region touches)."""
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    return torch.get_rng_state(), [(i, torch.cuda.get_rng_state(i)) for i in cuda]


@contextlib.contextmanager
def _rng_restored(state):
    if state is None:
        yield
        return
    cpu, cuda = state
    with torch.random.fork_rng(devices=[i for i, _ in cuda], device_type="cuda"):
        torch.set_rng_state(cpu)
        for i, s in cuda:
            torch.cuda.set_rng_state(s, i)
        yield


def rng_bytes(graph: Graph) -> int:
    cpu, cuda = capture_rng({s.device for s in graph.storages})
    return cpu.numel() + sum(s.numel() for _, s in cuda)


def make_plan(graph: Graph, budget_bytes: int, dropped: set | None = None) -> Plan:
    """Plans ``graph``: under ``budget_bytes``, or (the traced call itself) with exactly the
    storages in ``dropped`` dropped and every other saved storage kept.

    Raises:
        RuntimeError: ``dropped`` is given and cannot all be rebuilt (the traced call already
            freed them), e.g. because the region wrote in place to a tensor it did not create.
    """
    storages = graph.storages
    packed = {p.storage for p in graph.packs}
    region = [s for s in sorted(packed) if storages[s].creator >= 0 and s not in graph.outputs]
    total = sum(storages[s].nbytes for s in region)
    candidates = region if dropped is None else sorted(dropped - set(graph.outputs))
    available = [s.creator < 0 or i in graph.outputs or (i in packed and i not in candidates)
                 for i, s in enumerate(storages)]
    final = {p.storage: storages[p.storage].versions[-1] for p in graph.packs}
    budget = 0 if dropped is not None else budget_bytes
    planner = _ext.load()
    kept_mask, steps, cost, exact, fits = planner.plan(
        [op.cost for op in graph.ops], [op.replayable for op in graph.ops], [op.reads for op in graph.ops],
        [p for _, p in graph.values], [s for s, _ in graph.values],
        [graph.is_leaf_value(v) for v in range(len(graph.values))], available,
        candidates, [storages[s].nbytes for s in candidates], [final[s] for s in candidates], budget)
    if dropped is not None and any(kept_mask):
        raise RuntimeError(
            "gradaccel.checkpoint: the region writes in place to a tensor it did not create, so what it "
            "saved for backward cannot be recomputed; use budget=0 (torch.utils.checkpoint) for this region.")
    kept_storages = {s for s, k in zip(candidates, kept_mask) if k}
    is_available = lambda s: available[s] or s in kept_storages  # noqa: E731
    keep = [is_available(p.storage) for p in graph.packs]
    steps_set = set(steps)
    reads, leaf_needed = {}, set()
    for op_id in steps:
        for i, x in enumerate(graph.ops[op_id].leaves):
            if isinstance(x, Ref):
                producer = graph.values[x.value][1]
                where = "meta" if x.meta_only else "replay" if producer in steps_set else "leaf"
                reads[(op_id, i)] = where
                if where == "leaf":
                    leaf_needed.add(x.storage)
    first_pack = {}
    for k, p in enumerate(graph.packs):
        first_pack.setdefault(p.storage, k)
    leaf_sources = {}
    for s in sorted(leaf_needed):
        if s in graph.outputs:
            leaf_sources[s] = ("out", graph.outputs[s])
        elif storages[s].creator < 0:
            kind, x = storages[s].external
            leaf_sources[s] = ("arg", x) if kind == "arg" else ("obj", x)
        else:
            leaf_sources[s] = ("pack", first_pack[s])
    uses_rng = any(graph.ops[i].random for i in steps)
    kept_bytes = sum(storages[s].nbytes for s in region if is_available(s))
    return Plan(graph, keep, steps, reads, leaf_sources, uses_rng, kept_bytes, total, budget,
                sum(graph.ops[i].flops for i in steps), cost, exact, fits)

