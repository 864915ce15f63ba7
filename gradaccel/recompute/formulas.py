"""A structure's size formulas: every number of a region's trace as a function of its input sizes.

A :class:`Formulas` is made from the symbolic pass (gradaccel/recompute/symbolic.py) of a traced
region: each storage's bytes, each op's FLOPs, bytes and arguments, each saved tensor's geometry,
and the guards under which the region takes the traced path, printed by torch's sympy printer
and compiled into one Python function of the input sizes (and size ints). At a new size of the
structure (gradaccel/recompute/structure.py), :meth:`Formulas.graph_at` evaluates it and builds
the trace at those sizes, with no trace taken; its ops are sized lazily (:class:`_SizedOp`).
The layers of a model, one kind, share one :class:`Formulas` and its sized traces (``at_sizes``).
"""

import copy
import dataclasses
import math

import torch

from gradaccel.recompute.cost import FLOPS_PER_BYTE, OpCost, price
from gradaccel.recompute.plan import Shared
from gradaccel.recompute.roles import Source
from gradaccel.recompute.trace import Graph, Op, Pack, Ref, Storage

MAX_SIZES = 4  # input sizes whose sized ops a structure's formulas keep (for the next layer's call)
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_size_int(x) -> bool:
    """A plain int argument that a structure treats as a size: exactly an int (no bool, no
    numpy int) of 2 or more, so that 0 and 1 are specialised as torch specialises sizes."""
    return type(x) is int and x >= 2


def geometry_of(flat: list) -> dict:
    """What a structure's calls differ by: {flat index: (shape, stride)} of each tensor
    argument, and {flat index: value} of each size int (:func:`is_size_int`)."""
    return {i: (tuple(x.shape), tuple(x.stride())) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(flat) if isinstance(x, torch.Tensor) or is_size_int(x)}



class Formulas:
    """Every number of a symbolic trace as a formula of the input sizes, compiled into one
    Python function; the guards and the input geometry checks among them."""

    def __init__(self, sym_graph: Graph, env, sources: dict, checks: list):
        from torch.utils._sympy.printers import PythonPrinter

        self.sym = sym_graph
        self.sources = sources
        self.symbols = sorted(sources, key=str)
        self._index: dict = {}
        self._exprs: list = []
        # Positions of the trace, as numbers: ("c", value) for a constant, else an index.
        self.nbytes = [self._num(s.nbytes) for s in sym_graph.storages]
        self.ops = []
        for op in sym_graph.ops:
            leaves = [self._geometry(x) if isinstance(x, Ref) else self._num(x) for x in op.leaves]
            self.ops.append((leaves, self._num(op.flops), self._num(op.nbytes)))
        self.packs = [self._geometry(p) for p in sym_graph.packs]
        self.checks = [(kind, i, d, self._num(v)) for kind, i, d, v in checks]
        self.guards = [self._add(env.simplify(g.expr)) for g in env.guards]
        self.symbolic_ops = [k for k, (leaves, f, b) in enumerate(self.ops)
                             if not _constant((leaves, f, b))]
        printer = PythonPrinter()
        names = ", ".join(str(s) for s in self.symbols)
        code = [printer.doprint(e) for e in self._exprs]
        self._fn = _compile(names, ", ".join(code))
        # What a sized trace is made of, as one function of the sizes (the values above are for
        # the guards, checks and replayed arguments): the bytes of storages with a formula,
        # (FLOPs, bytes) of ops with one, and every saved tensor's geometry.
        text = lambda n: repr(n[1]) if isinstance(n, tuple) else f"({code[n]})"  # noqa: E731
        view = lambda g: f"(({''.join(text(m) + ', ' for m in g[0])}), ({''.join(text(m) + ', ' for m in g[1])}), {text(g[2])})"  # noqa: E731
        self.sized_storages = [k for k, n in enumerate(self.nbytes) if not isinstance(n, tuple)]
        layout = ("(" + "".join(text(self.nbytes[k]) + ", " for k in self.sized_storages) + "), ("
                  + "".join(f"({text(self.ops[k][1])}, {text(self.ops[k][2])}), " for k in self.symbolic_ops) + "), ("
                  + "".join(view(g) + ", " for g in self.packs) + ")")
        self._layout = _compile(names, layout)
        self.template: Graph | None = None  # the traced graph these formulas resize (set once they match it)
        self._balance = None  # op -> bytes' price in FLOPs, under the "flops" cost model
        # Input sizes -> _AtSize, for the last few sizes. The copies that other callables of the
        # kind get (_shared) share it: the layers of a model, called one after another at a new
        # length, size and plan it once. Their traces matched these formulas op for op
        # (arguments included), so a trace sized for one is the other's but for its own tensors.
        self.at_sizes: dict = {}

    def _add(self, expr) -> int:
        k = self._index.get(expr)
        if k is None:
            k = self._index[expr] = len(self._exprs)
            self._exprs.append(expr)
        return k

    def _num(self, v):
        if isinstance(v, _SYM):
            expr = v.node.expr
            if not expr.free_symbols:
                return ("c", _plain(v))
            if not expr.free_symbols <= set(self.sources):
                raise ValueError(f"a size formula reads a symbol that is no input size: {expr}")
            return self._add(expr)
        return ("c", v)

    def _geometry(self, view) -> tuple:
        return (tuple(self._num(v) for v in view.size), tuple(self._num(v) for v in view.stride),
                self._num(view.offset))

    # -- evaluation ----------------------------------------------------------------------------
    def _values(self, geometry: dict):
        """All formulas at the input geometry (:func:`geometry_of`); None where the inputs do
        not have the symbolic inputs' geometry or a guard fails."""
        args = []
        for s in self.symbols:
            kind, i, d = self.sources[s]
            if kind == "int":
                args.append(geometry[i])
                continue
            shape, stride = geometry[i]
            args.append(shape[d] if kind == "size" else stride[d])
        args = tuple(args)
        known = self.at_sizes.get(args)
        try:
            values = self._fn(*args) if known is None else known.values
        except Exception:  # a formula undefined at these sizes (a division by a size of 0)
            return None
        for kind, i, d, n in self.checks:
            if _at(n, values) != (geometry[i] if kind == "int" else geometry[i][0 if kind == "size" else 1][d]):
                return None
        if not all(values[g] for g in self.guards):
            return None
        return values, args

    def matches(self, graph: Graph, geometry: dict, why: list | None = None) -> bool:
        """Whether the symbolic trace is ``graph`` op for op, and its formulas give ``graph``'s
        numbers at ``graph``'s sizes: then they hold wherever the guards do. ``why`` (a list)
        gets the first difference."""
        why = [] if why is None else why
        found = self._values(geometry)
        sym = self.sym
        if found is None:
            return why.append("the formulas do not hold at the traced sizes") or False
        values = found[0]
        if len(sym.ops) != len(graph.ops) or sym.values != graph.values or len(sym.packs) != len(graph.packs) \
                or sym.outputs != graph.outputs or sym.activations != graph.activations:
            return why.append("another graph") or False
        for k, (s, g, n) in enumerate(zip(sym.storages, graph.storages, self.nbytes)):
            ext = (s.external.source, s.external.at if s.external.source is Source.ARG else None) if s.external else None
            if (s.creator, s.device, _at(n, values)) != (g.creator, g.device, g.nbytes) or ext != (
                    (g.external.source, g.external.at if g.external.source is Source.ARG else None) if g.external else None):
                return why.append(f"storage {k}") or False
        for k, (s, g, (leaves, flops, nbytes)) in enumerate(zip(sym.ops, graph.ops, self.ops)):
            if (s.func, s.spec, s.reads, s.new_storages, s.replayable, s.random, len(s.leaves)) != (
                    g.func, g.spec, g.reads, g.new_storages, g.replayable, g.random, len(g.leaves)):
                return why.append(f"op {k} {g.func}") or False
            if (_at(flops, values), _at(nbytes, values)) != (g.flops, g.nbytes):
                return why.append(f"op {k} {g.func}: flops/bytes {_at(flops, values)} {g.flops} {_at(nbytes, values)} {g.nbytes}") or False
            for i, (x, y, n) in enumerate(zip(s.leaves, g.leaves, leaves)):
                if isinstance(x, Ref) != isinstance(y, Ref):
                    return why.append(f"op {k} {g.func} argument {i}") or False
                if isinstance(x, Ref):
                    if (x.storage, x.value, x.dtype, x.device, x.meta_only) != (y.storage, y.value, y.dtype, y.device,
                                                                             y.meta_only) \
                            or not _same_view(_view_at(n, values), (y.size, y.stride, y.offset)):
                        return why.append(f"op {k} {g.func} tensor {i}: {_view_at(n, values)} {y}") or False
                elif not _same(_at(n, values), y):
                    return why.append(f"op {k} {g.func} argument {i}: {_at(n, values)!r} {y!r}") or False
        for k, (s, g, n) in enumerate(zip(sym.packs, graph.packs, self.packs)):
            # An argument saved as it is has the caller's autograd node (the fake one has none).
            made_inside = graph.storages[g.storage].creator >= 0
            if (s.storage, s.value, s.dtype) != (g.storage, g.value, g.dtype) or made_inside and s.grad_fn != g.grad_fn \
                    or not _same_view(_view_at(n, values), (g.size, g.stride, g.offset)):
                return why.append(f"saved tensor {k}") or False
        return True

    def graph_at(self, flat: list) -> Graph | None:
        """The template's trace at the sizes of ``flat`` (None where a guard fails)."""
        found = self._values(geometry_of(flat))
        return None if found is None else self._build(*found)

    def _build(self, values, args) -> Graph:
        t = self.template
        at = self.at_sizes.pop(args, None)
        if at is None:
            at = self._at(values, args)
        self.at_sizes[args] = at  # most recent last
        while len(self.at_sizes) > MAX_SIZES:
            self.at_sizes.pop(next(iter(self.at_sizes)))
        g = copy.copy(t)
        g.sized = True
        g.shared, g.ops, g.activation_bytes = at.shared, at.graph.ops, at.graph.activation_bytes
        if at.graph.template is t:
            g.storages, g.packs = at.graph.storages, at.graph.packs
            return g
        # Another callable of the kind (a later layer): its trace matched the formulas op for op,
        # so the sized ops are the first's; its own are the storages it reads from outside (its
        # parameters), and the saved arguments' autograd nodes where those differ.
        objects, kinds = self._own()
        g.storages = storages = list(at.graph.storages)
        for k in objects:
            s = t.storages[k]
            storages[k] = s if s.nbytes == storages[k].nbytes else \
                Storage(storages[k].nbytes, s.device, s.creator, s.external, s.versions)
        g.packs = at.packs.get(kinds)
        if g.packs is None:
            g.packs = at.packs[kinds] = _packs(t.packs, at.views)
        return g

    def _at(self, values, args) -> "_AtSize":
        """The template's trace at these sizes (to be shared with the other callables of its kind)."""
        t = self.template
        storage_bytes, op_counts, views = self._layout(*args)
        g = copy.copy(t)
        g.template = t
        g.storages = storages = list(t.storages)
        for k, nbytes in zip(self.sized_storages, storage_bytes):
            s = storages[k]
            storages[k] = Storage(nbytes, s.device, s.creator, s.external, s.versions)
        g.ops = ops = list(t.ops)
        for k, op in zip(self.symbolic_ops, self._sized_ops(values, op_counts)):
            ops[k] = op
        g.packs = _packs(t.packs, views)
        g.activation_bytes = sum(storages[s].nbytes for s in g.activations)
        return _AtSize(values, views, g, {self._own()[1]: g.packs}, Shared())

    def _own(self) -> tuple:
        """What of the template is its own among the callables of its kind: the storages it
        reads from outside its arguments (a layer's parameters), and its saved tensors'
        autograd node kinds (a saved argument's is its caller's). Worked out once per template
        (the copies _shared makes carry the original's, for another template)."""
        if self.__dict__.get("_own_of") is not self.template:
            t = self.template
            self._own_of = t
            self._own_parts = ([k for k, s in enumerate(t.storages) if s.external is not None
                                and s.external.source is Source.OBJ], tuple(p.grad_fn for p in t.packs))
        return self._own_parts

    def _sized_ops(self, values, op_counts) -> list:
        """The template's ops with formulas, at the sizes ``values`` (with their op_counts)."""
        t = self.template
        flops_model = isinstance(t.cost, str) and t.cost == "flops"
        if self._balance is None:
            self._balance = {k: FLOPS_PER_BYTE["cpu" if self._device(k).type == "cpu" else "cuda"]
                             for k in self.symbolic_ops}
        out = []
        for k, (flops, nbytes) in zip(self.symbolic_ops, op_counts):
            op = t.ops[k]
            sized = object.__new__(_SizedOp)
            fields = sized.__dict__
            fields.update(op.__dict__)
            del fields["leaves"]
            fields["flops"], fields["nbytes"], fields["resize"] = flops, nbytes, (self, k, values)
            fields["priced"] = self.sym.ops[k].priced  # an op priced by time: "measured, scaled" here
            fields["cost"] = flops + self._balance[k] * nbytes if flops_model else \
                price(t.cost, OpCost(str(op.func), flops, nbytes, self._device(k)), None)
            out.append(sized)
        return out

    def _device(self, k: int) -> torch.device:
        """The device an op is priced on (as the recorder prices it: its first tensor's)."""
        return next((r.device for r in self.template.ops[k].leaves if isinstance(r, Ref)), torch.device("cpu"))

    def leaves_at(self, k: int, values) -> list:
        """Op ``k``'s arguments at the sizes ``values``."""
        return [x if isinstance(n, tuple) and n and n[0] == "c" else
                (Ref(x.storage, x.value, *_view_at(n, values), x.dtype, x.device, x.meta_only)
                 if isinstance(x, Ref) else _at(n, values)) for x, n in zip(self.template.ops[k].leaves, self.ops[k][0])]


@dataclasses.dataclass
class _AtSize:
    """A structure's formulas at one input size: the values of every formula, the saved
    tensors' views, the trace sized there by the first callable of the kind that asked
    (``graph``, with ``graph.template`` its template), the sized saved tensors by their
    autograd node kinds (a saved argument's is its caller's: the first layer's input comes from
    the embedding, the others' from a layer), and what the planner made (shared by the kind's
    other callables at these sizes)."""

    values: tuple
    views: tuple
    graph: Graph
    packs: dict
    shared: Shared


def _packs(packs: list, views) -> list:
    """``packs`` with the (size, stride, offset) of ``views``."""
    out = []
    for p, (size, stride, offset) in zip(packs, views):  # Pack is frozen: filled as its __init__ would
        q = object.__new__(Pack)
        q.__dict__.update(p.__dict__)
        q.__dict__.update(size=size, stride=stride, offset=offset)
        out.append(q)
    return out


class _SizedOp(Op):
    """An op of a trace sized from formulas. Its arguments are sized when first read, by replay
    (most ops are never replayed): planning reads only costs and dependencies."""

    @property
    def leaves(self) -> list:
        found = self.__dict__.get("_leaves")
        if found is None:
            formulas, k, values = self.resize
            found = self.__dict__["_leaves"] = formulas.leaves_at(k, values)
        return found


def _compile(names: str, body: str):
    """``lambda <names>: (<body>,)``: our own printed formulas, over torch's and math's names."""
    return eval(f"lambda {names}: ({body},)", {"torch": torch, "math": math})  # noqa: S307


def _constant(n) -> bool:
    """Whether a (nested) number position holds no formula."""
    if isinstance(n, int):
        return False
    if isinstance(n, tuple) and len(n) == 2 and n[0] == "c":
        return True
    return all(_constant(m) for m in n)


def _same_view(a: tuple, b: tuple) -> bool:
    """Two (size, stride, offset) that address the same elements: a dim of size 1 has any stride."""
    return a[0] == b[0] and a[2] == b[2] and all(x == y or d == 1 for x, y, d in zip(a[1], b[1], a[0]))


def strays(t: torch.Tensor, pack) -> bool:
    """Whether a saved tensor's strides or offset differ from what a sized trace predicted."""
    return t.storage_offset() != pack.offset or not _same_view((tuple(t.shape), t.stride(), 0),
                                                               (pack.size, pack.stride, 0))


def _at(n, values):
    return n[1] if isinstance(n, tuple) else values[n]


def _view_at(n, values) -> tuple:
    size, stride, offset = n
    return tuple(_at(m, values) for m in size), tuple(_at(m, values) for m in stride), _at(offset, values)


def _plain(v):
    """A symbolic number with no free symbol, as a Python number."""
    return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(v)](v)


def _same(a, b) -> bool:
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                       and not isinstance(a, bool) and not isinstance(b, bool)):
        return False
    try:
        return bool(a == b) or (a != a and b != b)  # NaN arguments
    except Exception:
        return False
