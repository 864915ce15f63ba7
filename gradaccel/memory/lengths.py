"""A step's profile as a function of the sequence length: fake-tensor profiles at a few lengths,
every quantity fitted as an exact polynomial in the length, and a profile at any other length
predicted from them without running anything.

A step at length ``T`` runs the same ops in the same order at every ``T`` (same structure), and
every tensor's bytes are a product of sizes, each affine in ``T``: a polynomial of degree 2 at
most (attention scores ``B*H*T*T``; everything else linear). So is every *moment* of a run: the
live bytes after each op. A phase's peak is the largest moment, which need not be one polynomial
(weights' gradients may dominate at short lengths, attention at long ones), so what is fitted is
each moment, and a peak at ``T`` is the max of the moments evaluated at ``T``: exact.

What is fitted, per structure (blocks of one kind trace alike):

- each kind's graph: every storage's bytes, every op's FLOPs and planner cost (the roofline
  cost is FLOPs plus bytes times an integer balance). The plan at ``T`` is then the C++
  planner's own, on that graph: what ``gradaccel.checkpoint`` plans at ``T`` for the same
  budget;
- the skeleton run (every block keep-nothing) after each op, and its phase marks;
- each block run alone, after each op, under each candidate plan: keep-least, keep-all,
  parts, and ``CANDIDATES`` keep sets spread over the frontiers of the longest and the
  shortest profiled length. At a predicted length a candidate is offered where it is the
  planner's own plan there for its bytes, so the budget ``memory=`` sets gives that very plan.

Fitted on three lengths (the smallest, the largest and the one nearest their middle), with
exact rational arithmetic; the polynomial must have integer coefficients, and must reproduce
every other profiled length exactly (bytes, FLOPs and costs are integers: equality, no
tolerance). Anything else (a different number of ops, a plan that is not on the candidate
list, tiles whose chunks are ``ceil(T / 4)`` tokens) is not predicted: :class:`LengthProfile`
says why in ``failed``, and the callers profile that length itself. Tiles are offered only at
profiled lengths.
"""

import copy
import dataclasses
import functools
import math

import numpy as np
import torch
from torch.utils._pytree import tree_map

from gradaccel.memory.parts import PARTS
from gradaccel.memory.profile import KEEP_ALL, Kind, Point, Profile, cheaper_front
from gradaccel.recompute.trace import Storage

__all__ = ["LengthProfile", "profile_lengths", "length_of", "at_length"]


def profile_lengths(longest: int, shortest: int | None = None) -> list | None:
    """The lengths to profile for ``[shortest, longest]``: both ends, a middle one, and one more
    to check the fit (None where the range is too short to hold four lengths)."""
    # Down to 8 tokens: shorter texts are few, and a length outside the range costs a profile.
    shortest = max(2, min(8, longest // 4)) if shortest is None else max(2, shortest)
    if longest - shortest < 3:
        return None
    mid = (shortest + longest) // 2
    check = (mid + longest + 1) // 2
    if check in (mid, longest):
        check = mid + 1
    return sorted({shortest, mid, check, longest})


CANDIDATES = 12  # plans per kind taken from each end's frontier and fitted across lengths


class _Unfit(Exception):
    pass


class _Poly:
    """Rows of integers measured at the same lengths, as integer polynomials of degree <= 2."""

    def __init__(self, lengths, rows):
        rows = [list(r) for r in rows]
        if len({len(r) for r in rows}) > 1:
            raise _Unfit("a different number of ops at different lengths")
        values = np.array(rows, dtype=object).T if rows and rows[0] else np.zeros((0, len(lengths)), dtype=object)
        if len(lengths) < 4:
            raise _Unfit("fewer than four lengths profiled (three to fit, one to check)")
        xs = [lengths[0], min(lengths[1:-1], key=lambda x: abs(2 * x - lengths[0] - lengths[-1])), lengths[-1]]
        cols = [lengths.index(x) for x in xs]
        # Lagrange over a common denominator: everything stays an exact Python int.
        dens = [math.prod(xs[k] - xs[j] for j in range(3) if j != k) for k in range(3)]
        den = abs(math.lcm(*dens))
        coef = np.zeros((values.shape[0], 3), dtype=object)
        for k in range(3):
            a, b = (xs[j] for j in range(3) if j != k)
            basis = np.array([1, -(a + b), a * b], dtype=object) * (den // dens[k])
            coef = coef + np.outer(values[:, cols[k]], basis) if values.size else coef
        if values.size and any(c % den for c in coef.ravel()):
            raise _Unfit("sizes that are not integer polynomials of the length")
        self.coef = np.array([[c // den for c in row] for row in coef], dtype=np.int64).reshape(-1, 3)
        for i, x in enumerate(lengths):
            if i not in cols and values.size and not np.array_equal(self(x), values[:, i].astype(np.int64)):
                raise _Unfit(f"the fit from lengths {xs} does not reproduce length {x}")

    def __call__(self, t: int) -> np.ndarray:
        if self.coef.size and int(np.abs(self.coef).max()) * (t * t + t + 1) >= 1 << 62:  # past int64: exact ints
            return (self.coef.astype(object) @ np.array([t * t, t, 1], dtype=object)).astype(object)
        return self.coef @ np.array([t * t, t, 1], dtype=np.int64)


@dataclasses.dataclass
class _Run:
    """One block run alone under one plan, at every profiled length: its moments, fitted."""

    moments: _Poly
    forward_end: int
    held: _Poly

    def at(self, t: int) -> tuple:
        m = self.moments(t)
        fwd = int(m[:self.forward_end].max(initial=0))
        return fwd, int(m.max(initial=0)), int(self.held(t)[0])


def plan_keeping(kind: Kind, keep: tuple):
    """The plan of ``kind``'s graph that keeps the saved tensors ``keep`` says (per pack),
    whatever the budget: a plan found at one length, made for another."""
    kept = {kind.graph.packs[k].storage for k, f in enumerate(keep) if f} & set(kind.graph.activations)
    return kind.planner.keeping(kept)


def _structure(graph) -> tuple:
    return (tuple(_structure_of_op(op) for op in graph.ops),
            tuple((p.storage, p.value) for p in graph.packs), tuple(graph.activations), tuple(sorted(graph.outputs.items())),
            tuple(s.creator for s in graph.storages))


def _block_name(prof, kind) -> str:
    """A kind's first block, as a user finds it: its index among the blocks and its class."""
    i = kind.blocks[0]
    return f"{i} ({type(prof.blocks[i]).__name__})"


def _first_difference(a, b) -> str:
    """The first op at which two traces of one block differ."""
    for k, (x, y) in enumerate(zip(a.ops, b.ops)):
        if _structure_of_op(x) != _structure_of_op(y):
            return f"op {k}: {x.func} against {y.func}"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} ops against {len(b.ops)}"
    return "what they save for backward"


def _structure_of_op(op) -> tuple:
    return str(op.func), tuple(op.reads), tuple(op.new_storages), op.replayable, op.random


class LengthProfile:
    """Profiles of one step structure at several lengths, and the profile at any length
    between the shortest and the longest, predicted (:meth:`at`).

    Args:
        make: ``make(length) -> Profile`` (with ``trajectories=True``): one fake-tensor run.
        lengths: at least four lengths (:func:`profile_lengths`).
        shared: a dict that length profiles of one model share (the step with the model's loss
            and with the loss in chunks, whose blocks are the same): a kind of block predicted at
            a length by one of them serves the others at that length, planned once.

    Attributes:
        failed: why lengths other than the profiled ones cannot be predicted, or None.
        profiles: length -> its :class:`Profile` (the profiled lengths are used as they are).
    """

    def __init__(self, make, lengths: list, shared: dict | None = None):
        self.make, self.failed = make, None
        self.shared = {} if shared is None else shared
        self.profiles = {}
        self.block_runs = 0  # block runs at profiled lengths made after the first fit (lazily)
        self._fits = None
        try:
            for t in sorted(lengths):
                self._run(t)
            self._fit()
        except _Unfit as e:
            self.failed = str(e)

    @property
    def lengths(self) -> list:
        return sorted(self.profiles)

    def covers(self, t: int) -> bool:
        """Whether the profile at ``t`` is known without a fake-tensor run."""
        return t in self.profiles or (self.failed is None and self.lengths[0] <= t <= self.lengths[-1])

    def extend(self, t: int) -> None:
        """Profiles length ``t`` (one fake-tensor run) and checks the fit reproduces it: where it
        does, lengths up to (down to) ``t`` are covered."""
        self._run(t)
        if self.failed is None:
            try:
                self._fit()
            except _Unfit as e:
                self.failed = str(e)

    def _run(self, t):
        prof = self.make(t)
        prof._length = t
        self.profiles[t] = prof

    # -- fitting ---------------------------------------------------------------------------------
    def _fit(self):
        lengths = self.lengths
        profs = [self.profiles[t] for t in lengths]
        base = profs[-1]
        keys = [[(k.key, tuple(k.blocks)) for k in p.kinds] for p in profs]
        if any(k != keys[0] for k in keys):
            raise _Unfit("blocks group into kinds differently at different lengths")
        for p in profs:
            for a, b in zip(p.kinds, base.kinds):
                if _structure(a.graph) != _structure(b.graph):
                    raise _Unfit(f"block {_block_name(p, a)} traces different ops at lengths {p._length} and "
                                 f"{base._length} ({_first_difference(a.graph, b.graph)})")
            if any(op.priced == "formula" and not float(op.cost).is_integer() for k in p.kinds for op in k.graph.ops):
                raise _Unfit("op costs that are not FLOP formulas (cost='measured')")
            if [m for _, m in p.events[1]] != [m for _, m in base.events[1]] or \
                    [i for i, _ in p.events[1]] != [i for i, _ in base.events[1]]:
                raise _Unfit("the step sets its phases differently at different lengths")
        fits = {"kinds": []}
        for j, kind in enumerate(base.kinds):
            ks = [p.kinds[j] for p in profs]
            graph = _Poly(lengths, [[s.nbytes for s in k.graph.storages] for k in ks])
            # Ops priced by a formula are fitted; an op outside aten (priced by its time in a
            # real trace, or by a bound) keeps the longest length's price.
            priced = [i for i, op in enumerate(kind.graph.ops) if op.priced == "formula"]
            flops = _Poly(lengths, [[k.graph.ops[i].flops for i in priced] for k in ks])
            cost = _Poly(lengths, [[int(k.graph.ops[i].cost) for i in priced] for k in ks])
            # The candidate plans, run at every profiled length: keep-all, keep-least, and
            # ``CANDIDATES`` plans spread over the frontiers of the longest and the shortest
            # length (and any fitted since: :meth:`peaks`).
            zero = tuple(kind.zero.plan.keep)
            old = self._fits["kinds"][j]["runs"] if self._fits else {}
            keeps = {zero: None}
            for k in (ks[-1], ks[0]):
                front = k.frontier
                for i in sorted({round(x * (len(front) - 1) / (CANDIDATES - 1)) for x in range(CANDIDATES)}):
                    keeps.setdefault(tuple(front[i].plan.keep), None)
            keeps.update((k, None) for k in old if k not in (KEEP_ALL, PARTS))
            runs = {KEEP_ALL: self._runs(profs, j, lambda k: KEEP_ALL)}
            for keep in keeps:
                runs[keep] = self._runs(profs, j, lambda k, keep=keep: _keeping(k, keep))
            for p, k in zip(profs, ks):
                p.options(k)  # parts (and tiles) runs, as the profile makes them
            if all(PARTS in k._peaks for k in ks):
                runs[PARTS] = self._runs(profs, j, lambda k: PARTS)
            # What a kind predicted at a length depends on, but for its candidates' runs: another
            # length profile's kind that agrees on all of it predicts the same kind. (Ops timed in
            # their trace are left out: each profile times the same op anew, a sample of one price.)
            same = (kind.key, tuple(kind.blocks), _structure(kind.graph), tuple(priced), graph.coef.tobytes(),
                    flops.coef.tobytes(), cost.coef.tobytes(), zero)
            fits["kinds"].append({"nbytes": graph, "flops": flops, "cost": cost, "priced": priced, "runs": runs,
                                  "zero": zero, "same": same})
        fits["moments"] = _Poly(lengths, [p.events[0] for p in profs])
        fits["marks"] = base.events[1]
        fits["pre"] = _Poly(lengths, [p.pre for p in profs])
        fits["held"] = _Poly(lengths, [p.held for p in profs])
        fits["end"] = _Poly(lengths, [[p.end_forward] for p in profs])
        self._fits = fits

    def peaks(self, j: int, keep: tuple, t: int) -> tuple | None:
        """(forward peak, peak, held after forward) of a block of kind ``j`` run alone at length
        ``t`` under the plan that keeps ``keep``; fitted from block runs at the profiled lengths
        the first time it is asked for. None where that plan's runs are not polynomial."""
        runs = self._fits["kinds"][j]["runs"]
        if keep not in runs:
            profs = [self.profiles[x] for x in self.lengths]
            self.block_runs += len(profs)
            try:
                runs[keep] = self._runs(profs, j, lambda k: _keeping(k, keep))
            except (_Unfit, RuntimeError):
                runs[keep] = None
        return None if runs[keep] is None else runs[keep].at(t)

    @staticmethod
    def _runs(profs, j, point_of) -> _Run:
        rows, held, ends = [], [], set()
        for p in profs:
            kind = p.kinds[j]
            point = point_of(kind)
            if point != PARTS:  # the parts run is made by Profile.options
                p.block_peak(kind, point)
            key = point if point in (KEEP_ALL, PARTS) else point.key
            trace, end = kind.events[key]
            rows.append(trace)
            held.append([kind._peaks[key][2]])
            ends.add(end)
        if len(ends) != 1:
            raise _Unfit("a block's forward runs a different number of ops at different lengths")
        lengths = [p._length for p in profs]
        return _Run(_Poly(lengths, rows), ends.pop(), _Poly(lengths, held))

    # -- predicting --------------------------------------------------------------------------------
    def at(self, t: int) -> Profile:
        """The profile at length ``t``: a profiled one as it is, else predicted (no run).

        Raises:
            ValueError: ``t`` is not covered (:meth:`covers`).
        """
        if t in self.profiles:
            return self.profiles[t]
        if not self.covers(t):
            raise ValueError(f"length {t} is not covered by the profiled lengths {self.lengths}")
        return _predicted(self, t)


def _keeping(kind: Kind, keep: tuple) -> Point:
    """``kind``'s plan keeping ``keep``, as a Point keyed by the keep set."""
    plan = plan_keeping(kind, keep)
    return Point(("keep", keep), plan.kept_bytes, plan.cost, plan.recompute_flops, plan.replay_peak, plan)


class _Predicted(Profile):
    """A :class:`Profile` at a length that was not run: every figure from the fitted moments."""

    def block_peak(self, kind, point) -> int:
        key = KEEP_ALL if point == KEEP_ALL else point.key
        if key not in kind._peaks:
            found = self._source.peaks(self.kinds.index(kind), tuple(point.plan.keep), self._length)
            # A plan whose runs are not polynomial in the length: never chosen.
            kind._peaks[key] = found if found is not None else (_NEVER, _NEVER, 0)
        return kind._peaks[key][1]

    def block_forward_peak(self, kind, point) -> int:
        self.block_peak(kind, point)
        return kind._peaks[KEEP_ALL if point == KEEP_ALL else point.key][0]

    def block_peak_estimate(self, kind, point) -> int:
        return self.block_peak(kind, point)  # the exact peak is known: no estimate needed

    def need(self, terms: dict, i: int, point, exact: bool = True) -> tuple:
        # Every candidate's peaks are fitted, so the split works on exact figures throughout.
        return super().need(terms, i, point, True)

    def options(self, kind, offload: bool = False) -> list:
        if offload:
            raise ValueError("offload plans are not predicted across lengths")
        return kind.frontier + (kind._options or [])


_NEVER = 1 << 62


def _predicted(source: LengthProfile, t: int) -> Profile:
    base, fits = source.profiles[source.lengths[-1]], source._fits
    prof = object.__new__(_Predicted)
    prof._source = source
    prof.mode, prof.model, prof.step, prof.batch = base.mode, base.model, base.step, base.batch
    prof.blocks, prof.grad_hooks, prof.trajectories, prof._terms = base.blocks, base.grad_hooks, False, {}
    prof.pinned_inputs = base.pinned_inputs  # gradaccel/recompute/host_inputs.py keeps these blocks' inputs
    prof._length = t
    prof.kinds = []
    if source.shared.get("length") != t:  # kinds are shared within one length's planning
        source.shared.clear()
        source.shared["length"] = t
    for kind, fit in zip(base.kinds, fits["kinds"]):
        same = (fit["same"], tuple((keep, run.moments.coef.tobytes(), run.forward_end, run.held.coef.tobytes())
                                   for keep, run in fit["runs"].items() if run is not None))
        if same not in source.shared:
            source.shared[same] = _kind_at(kind, fit, t)
        prof.kinds.append(source.shared[same])
    prof.kind_of = {i: k for k in prof.kinds for i in k.blocks}
    moments = fits["moments"](t)
    phases, label, bounds = {}, None, [i for i, _ in fits["marks"]] + [len(moments)]
    for (start, label), end in zip(fits["marks"], bounds[1:]):
        first, peak = phases.get(label, (int(moments[start]), 0))
        phases[label] = (first, max(peak, int(moments[start:end].max(initial=0))))
    prof.phases = phases
    prof.pre = [int(v) for v in fits["pre"](t)]
    prof.held = [int(v) for v in fits["held"](t)]
    prof.end_forward = int(fits["end"](t)[0])
    return prof


def _kind_at(kind: Kind, fit: dict, t: int) -> Kind:
    """``kind`` at length ``t``: its graph sized from the fits, its keep-least, keep-all and
    parts runs; its frontier is made when first asked for (:class:`_KindAt`)."""
    graph = copy.copy(kind.graph)
    flops, cost = fit["flops"](t), fit["cost"](t)
    graph.storages = [s if s.nbytes == b else Storage(int(b), s.device, s.creator, s.external, s.versions)
                      for s, b in zip(kind.graph.storages, fit["nbytes"](t))]
    graph.ops = ops = list(kind.graph.ops)
    for i, f, c in zip(fit["priced"], flops, cost):
        op = ops[i] = object.__new__(type(ops[i]))  # a copy, as copy.copy makes it (at a third of its time)
        op.__dict__.update(kind.graph.ops[i].__dict__, flops=int(f), cost=float(c))
    graph.activation_bytes = sum(graph.storages[s].nbytes for s in graph.activations)
    k = _KindAt(kind.key, list(kind.blocks), graph, kind.args, kind.kwargs, input_grads=kind.input_grads)
    k.fit, k.length = fit, t
    k.forward_cost = sum(op.cost for op in graph.ops)
    k.zero = k.plan_at(1)
    runs = fit["runs"]
    if tuple(k.zero.plan.keep) != fit["zero"]:
        raise ValueError(f"at length {t} the keep-least plan is not the profiled one")
    k._peaks[k.zero.key] = runs[fit["zero"]].at(t)
    k._peaks[KEEP_ALL] = runs[KEEP_ALL].at(t)
    k._options = []
    if PARTS in runs:
        k._peaks[PARTS] = runs[PARTS].at(t)
        point = Point(PARTS, k.zero.kept, k.zero.cost, k.zero.flops, 0, PARTS)
        point.kept += k._peaks[PARTS][2] - k._peaks[k.zero.key][2]
        k._options.append(point)
    return k


class _KindAt(Kind):
    """A kind at a predicted length. Its frontier costs a planner call per fitted candidate, so
    it is made when first asked for: a step whose blocks all fit uncheckpointed never asks."""

    @functools.cached_property
    def frontier(self) -> list:
        # The candidates that are the planner's own plan at this length for their bytes: a
        # budget of that many bytes gives gradaccel.checkpoint that very plan here.
        graph, t = self.graph, self.length
        found = {self.zero.key: self.zero}
        region = set(graph.activations)
        for keep, run in self.fit["runs"].items():
            if keep in (KEEP_ALL, PARTS) or run is None:
                continue
            kept = {graph.packs[i].storage for i, f in enumerate(keep) if f} & region
            p = self.plan_at(max(1, sum(graph.storages[sid].nbytes for sid in kept)))  # the bytes it keeps at t
            if tuple(p.plan.keep) == keep and p.key not in found:
                self._peaks[p.key] = run.at(t)
                found[p.key] = p
        return cheaper_front(sorted(found.values(), key=lambda p: (p.kept, p is not self.zero)))  # keep-least first


# -- the length of a call ------------------------------------------------------------------------
def length_of(flat: list) -> tuple:
    """(sequence length, structure key) of a call's flattened arguments, or (None, None).

    The length is dimension 1 of the first 2-d integer tensor (token ids, ``(batch, length)``),
    else of the first 3-d floating tensor (``(batch, length, channels)``). The structure key is
    the tensors' shapes with every dimension equal to the length left out, and their dtypes."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    first = next((t for t in tensors if t.dim() == 2 and not t.is_floating_point()), None)
    if first is None:
        first = next((t for t in tensors if t.dim() == 3 and t.is_floating_point()), None)
    if first is None:
        return None, None
    t_len = first.shape[1]
    key = tuple((tuple(None if d == t_len else d for d in t.shape), t.dtype, t.requires_grad) for t in tensors)
    return t_len, key


def at_length(tree, old: int, new: int):
    """``tree`` with each tensor replaced by zeros whose dimensions equal to ``old`` are ``new``
    (only shapes and dtypes matter to a fake-tensor profile)."""
    def resize(t):
        if not isinstance(t, torch.Tensor):
            return t
        shape = tuple(new if d == old else d for d in t.shape)
        return torch.zeros(shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)

    return tree_map(resize, tree)
