"""Plans that hold across sizes: one trace per *structure* of a region, sized per call.

A region's trace (gradaccel/recompute/trace.py) is taken at one input signature. Sequence lengths change
almost every step in real fine-tuning, so plans are cached per *structure*: the signature with
the sizes and strides of its tensors left out (what stays: rank, which sizes and strides are 0
or 1, storage offsets, dtypes, devices, aliasing, every non-tensor argument but plain ints,
module state). A plain int argument of 2 or more (``max_length_q``, a length passed as a
number) is a size too: it is left out of the structure, and is a symbol of its own in the
symbolic pass, so formulas and guards may read it (0 and 1 stay in the key, as sizes do).

Within a structure, the first traced call is the *template*. When a call of another size comes,
the region's Python runs once more, on fake tensors whose sizes and strides are symbols (torch's
``ShapeEnv``, one symbol per input size or stride, never merged by value), under the same
recorder. That gives every number of the trace (op arguments such as view shapes and arange
lengths, tensor geometry, storage bytes, FLOPs) as a formula of the input sizes, and the
*guards*: the conditions on the sizes under which the region takes the same path (a branch on
the length, a slice inside a buffer, a kernel choice that reads sizes). The symbolic trace must
match the template op for op, and its formulas must give back the template's numbers at the
template's sizes, or it is not used.

Every later call of the structure at a new size is then: evaluate the formulas and guards (one
compiled Python function), build the trace at those sizes, and plan it (the C++ planner). No
trace, no recompute beyond that size's plan. Where a guard fails (the structure changes with the
size), the call is traced anew and becomes another template. The frame checks every saved tensor
of a sized plan against the formulas' shape, stride and offset (gradaccel/recompute/frames.py), so a call
that strays from the prediction keeps what it saves and is traced again next time.
"""

import contextlib
import copy
import dataclasses
import functools
import math
import threading
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradaccel.recompute import engine as _engine
from gradaccel.recompute import split_off as _split
from gradaccel.recompute.cost import FLOPS_PER_BYTE, OpCost, price
from gradaccel.recompute.roles import Source
from gradaccel.recompute.backports import parameter_subclasses, python_matmul
from gradaccel.recompute.plan import Shared
from gradaccel.recompute.trace import Graph, Op, Pack, Recorder, Ref, Storage, is_foreign

MAX_TEMPLATES = 4  # traces kept per structure (a structure that changes with the size has several)
MAX_STRUCTURES = 16  # structures kept per callable; the least recently used goes first
MAX_RETRACE = 64  # signatures of a structure waiting to be traced again
MAX_SIZES = 4  # input sizes whose sized ops a structure's formulas keep (for the next layer's call)
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_FAKE_PASS = []  # non-empty while a region's Python runs on symbolic fake tensors


def in_fake_pass() -> bool:
    """True inside the symbolic pass: a nested ``gradaccel.checkpoint`` then runs its function plainly."""
    return bool(_FAKE_PASS)


def without_sizes(part):
    """One part of a plan's key (gradaccel/recompute/checkpoint.py ``_signature``) as a structure keeps it:
    of a tensor's geometry, its rank, which sizes and strides are 0 or 1 (torch's symbolic shapes
    specialise those) and its storage offset. Other parts stay as they are."""
    if type(part) is tuple and len(part) == 5 and type(part[0]) is tuple and len(part[0]) == 3 \
            and type(part[0][0]) is torch.Size:
        shape, stride, offset = part[0]
        return ((len(shape), tuple(d if d < 2 else -1 for d in shape), tuple(s if s < 2 else -1 for s in stride),
                 offset),) + part[1:]
    if type(part) is tuple and len(part) == 2 and part[0] is int and is_size_int(part[1]):
        return (int, "size")  # not -1: an argument of -1 stays a structure of its own
    return part


def is_size_int(x) -> bool:
    """A plain int argument that a structure treats as a size: exactly an int (no bool, no
    numpy int) of 2 or more, so that 0 and 1 are specialised as torch specialises sizes."""
    return type(x) is int and x >= 2


def geometry_of(flat: list) -> dict:
    """What a structure's calls differ by: {flat index: (shape, stride)} of each tensor
    argument, and {flat index: value} of each size int (:func:`is_size_int`)."""
    return {i: (tuple(x.shape), tuple(x.stride())) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(flat) if isinstance(x, torch.Tensor) or is_size_int(x)}


@dataclasses.dataclass
class Template:
    """A traced graph of a structure, the sizes it was traced at, and (once a call of another
    size asked) its formulas: a :class:`Formulas`, or False where they could not be had."""

    graph: Graph
    geometry: dict  # flat index -> (shape, stride) of each tensor argument, or value of each size int, when traced
    formulas: object = None
    why: str = ""  # where formulas is False: why they could not be had (for warnings and plan_rows)


class Structure:
    """The templates of one structure (most recently used first) and its counters."""

    def __init__(self):
        self.templates: list[Template] = []
        self.traces = 0  # calls traced for this structure
        self.sized = 0  # calls planned from formulas, with no trace
        self.planned = 0  # calls that ran a plan made at an earlier call of the same signature
        self.retrace: set = set()  # exact signatures to trace on their next call (a sized call strayed)
        self.kind = None  # what callables of the same code and settings share (see module_kind)
        self.passes = 0  # symbolic passes run for it (each costs about a forward's Python, on fake tensors)
        self.why = ""  # why its last symbolic pass gave no formulas (new sizes are then traced)

    def add(self, graph: Graph, flat: list) -> None:
        self.traces += 1
        geometry = geometry_of(flat)
        self.templates.insert(0, Template(graph, geometry))
        del self.templates[MAX_TEMPLATES:]

    def strayed(self, key) -> None:
        """A call sized from formulas saved other tensors than predicted: its exact signature is
        traced on its next call (a bounded set: one forgotten is merely sized, and strays, again)."""
        if len(self.retrace) >= MAX_RETRACE:
            self.retrace.pop()
        self.retrace.add(key)

    def sized_graph(self, fn, flat: list, spec) -> Graph | None:
        """The trace at the sizes of ``flat``, from a template's formulas; None where no
        template holds at these sizes (the call is to be traced)."""
        for k, template in enumerate(self.templates):
            if template.formulas is None:
                self._find_formulas(template, fn, flat, spec)
            if template.formulas:
                graph = template.formulas.graph_at(flat)
                if graph is not None:
                    self.templates.insert(0, self.templates.pop(k))
                    self.sized += 1
                    return graph
        return None


    def prepare(self, fn, flat: list, spec) -> None:
        """Finds the newest template's formulas now, at the call that traced it, rather than at
        the first call of another size: for a region whose caller said its lengths will vary
        (``checkpoint_blocks(..., seq=...)``), so that the symbolic pass is paid at the start of
        training, not at some step in the middle of it."""
        template = self.templates[0]
        if template.formulas is None and not any(isinstance(x, FakeTensor) for x in flat):
            self._find_formulas(template, fn, flat, spec)

    def _find_formulas(self, template: Template, fn, flat: list, spec) -> None:
        """Sets ``template.formulas``: another callable of the kind's that match it, else a
        symbolic pass at the sizes of ``flat`` (False where none can be had)."""
        template.formulas = _shared(self.kind, template)
        if template.formulas is None and self.passes < MAX_TEMPLATES:  # not one pass per length
            self.passes += 1
            template.formulas = analyse(template, fn, flat, spec)
        template.formulas = template.formulas or False
        if template.formulas:
            self.why = ""
            if self.kind is not None:
                _share(self.kind, template.formulas)
        elif template.why:
            self.why = template.why


def structures_of(shapes: dict, key) -> Structure:
    """The Structure for ``key`` in one callable's ``shapes`` (an LRU dict), made if new."""
    structure = shapes.pop(key, None) or Structure()
    shapes[key] = structure
    while len(shapes) > MAX_STRUCTURES:
        shapes.pop(next(iter(shapes)))
    return structure


def module_kind(module: torch.nn.Module, plain) -> tuple:
    """Modules of one kind run the same code on the same settings: each submodule's class, its
    plain attributes except layer indices (``layer_idx``) and gradaccel's own settings (the
    budget memory= or fit gives each block), its parameters' and buffers' shapes, dtypes and
    trainability. The layers of a model are one kind, so one symbolic pass serves all of them,
    and a new length is sized once for all (each layer's own trace must still match the
    formulas op for op)."""
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in sub.__dict__.items()
                             if plain(v) and not k.endswith(("idx", "index")) and not k.startswith("_gradaccel_")))
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in sub._parameters.items() if p is not None)
        buffers = tuple((k, tuple(b.shape), b.dtype) for k, b in sub._buffers.items() if b is not None)
        parts.append((name, type(sub), attrs, params, buffers))
    return tuple(parts)


MAX_KINDS = 64  # kinds whose formulas are kept for other callables of the kind


def _shared(kind, template: Template):
    """Formulas another callable of ``kind`` found, rebound to ``template`` if they match it."""
    from gradaccel.recompute.state import STATE

    for formulas in STATE.kinds.get(kind, ()) if kind is not None else ():
        if formulas.matches(template.graph, template.geometry):
            mine = copy.copy(formulas)
            mine.template = template.graph
            return mine
    return None


def _share(kind, formulas) -> None:
    from gradaccel.recompute.state import STATE

    found = STATE.kinds.pop(kind, [])
    STATE.kinds[kind] = [formulas] + [f for f in found if f.sym is not formulas.sym][:MAX_TEMPLATES - 1]
    while len(STATE.kinds) > MAX_KINDS:
        STATE.kinds.pop(next(iter(STATE.kinds)))


# -- the symbolic pass -------------------------------------------------------------------------
class _SymbolicGraph(Graph):
    """The trace on fake tensors. Real tensors the region reads (parameters, buffers), which the
    fake mode converts on each use, are known by their fake (one per tensor, static sizes), so
    that an op and autograd's saving of the same parameter name one storage."""

    def __init__(self, flat_args: list, preserve_rng_state: bool, mode):
        super().__init__(flat_args, preserve_rng_state, "flops")
        self.mode = mode

    def storage_of(self, t: torch.Tensor) -> int:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(t, FakeTensor):
            t = self.mode.fake_tensor_converter.from_real_tensor(self.mode, t)
        return super().storage_of(t)


class _SymbolicRecorder(Recorder):
    """The tracer (which skips the ``prim`` ops that fake tensors run for metadata), minus what
    only symbolic sizes dispatch: full slices (``x[:, :, None]``), which indexing skips on real
    tensors but cannot prove full on symbolic ones. Each is a no-op for replay.

    An op from outside aten takes from the template (``like``, the traced graph) what its fake
    kernel cannot know: its outputs' dtypes (a kernel whose own aten ops autocast casts returns
    another dtype than its fake says) and, where it has no FLOP formula, its price, scaled from
    the traced call's by the elements of its largest input."""

    def __init__(self, graph: Graph, like: Graph):
        super().__init__(graph)
        self.like = like

    def _twin(self, func, k: int) -> Op | None:
        """The template's op at position ``k``, if it is the same op."""
        op = self.like.ops[k] if k < len(self.like.ops) else None
        return op if op is not None and op.func is func else None

    def foreign_result(self, func, out):
        twin = self._twin(func, len(self.graph.ops))  # the position the op is about to take
        if twin is None or not twin.out_dtypes:
            return out
        leaves, spec = tree_flatten(out)
        tensors = iter(twin.out_dtypes)
        leaves = [_retyped(x, next(tensors, x.dtype)) if isinstance(x, torch.Tensor) else x for x in leaves]
        return tree_unflatten(leaves, spec)

    def _price_foreign(self, func) -> None:
        """The op just recorded, priced as the template's op scaled by its largest input."""
        twin, op = self._twin(func, len(self.graph.ops) - 1), self.graph.ops[-1]
        if twin is None or twin.priced == "formula" or op.priced == "formula":
            return
        refs = [(i, x) for i, x in enumerate(twin.leaves) if isinstance(x, Ref)]
        if not refs:
            return
        i, largest = max(refs, key=lambda r: math.prod(r[1].size))
        now = math.prod(op.leaves[i].size) if isinstance(op.leaves[i], Ref) else None
        if now is None or not math.prod(largest.size):
            return
        op.flops = twin.flops * now // math.prod(largest.size)  # no max(): it would guard on the size
        op.priced = f"{twin.priced}, scaled"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and torch.is_autocast_cache_enabled() and _cacheable(args[0]):
            # Autocast's cast of a real parameter with its cache on again (the region entered an
            # autocast(cache_enabled=True)): the fake result would be cached for the real forward
            # to read. Raised before it is: this region is traced per size (analyse returns None).
            raise RuntimeError("gradaccel: autocast would cache a cast made on fake tensors")
        if func is torch.ops.aten.slice.Tensor:
            out = func(*args, **(kwargs or {}))
            if _same_geometry(out, args[0]):
                return out
            self.graph.record(func, args, kwargs or {}, out)
            return out
        n = len(self.graph.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if is_foreign(func) and len(self.graph.ops) > n and not self.paused:
            self._price_foreign(func)
        return out


def _retyped(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` (a fake tensor) as ``dtype``, same geometry: what the real kernel returned."""
    if t.dtype == dtype:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def _cacheable(t) -> bool:
    """Whether autocast caches its casts of ``t`` (a real leaf that requires grad, as a parameter)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.is_leaf and t.requires_grad


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same size, stride and offset formulas (no guard is added)."""
    expr = lambda v: str(v.node.expr) if isinstance(v, torch.SymInt) else str(v)  # noqa: E731
    return [expr(v) for v in (*a.shape, *a.stride(), a.storage_offset())] == \
        [expr(v) for v in (*b.shape, *b.stride(), b.storage_offset())]


@contextlib.contextmanager
def _isolated():
    """The symbolic pass leaves no trace outside: no outer tracer or region sees its ops, the
    generator does not move, its warnings (the user's code runs twice) are not shown, no module
    hooks run (:func:`_call_without_hooks`), and autocast's cache is off: a cast of a parameter
    is cached until the outermost autocast exits, so a fake cast cached here would be the weight
    of every later real op in that autocast (and a real one read here is not on the template's
    path)."""
    from torch.utils._python_dispatch import _disable_current_modes

    saved, _split._ACTIVE[:] = list(_split._ACTIVE), []
    _FAKE_PASS.append(threading.get_ident())
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    global _CALL_IMPL
    call_impl = _CALL_IMPL = torch.nn.Module._call_impl
    torch.nn.Module._call_impl = _call_without_hooks
    try:
        with _disable_current_modes(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.nn.Module._call_impl = call_impl
        torch.set_autocast_cache_enabled(cache)
        _FAKE_PASS.pop()
        _split._ACTIVE[:] = saved


_CALL_IMPL = torch.nn.Module._call_impl  # what other threads run meanwhile (set by _isolated)


def _call_without_hooks(self, *args, **kwargs):
    """``Module.__call__`` in the symbolic pass (its thread only): ``forward`` alone. Hooks are
    Python with effects on real objects (a probe's list, HF's output capture), run by the real
    call; a hook that changes what the region computes leaves the symbolic trace unlike the
    template, so it is not used (the region is traced per size)."""
    if _FAKE_PASS and _FAKE_PASS[-1] == threading.get_ident():
        return self.forward(*args, **kwargs)
    return _CALL_IMPL(self, *args, **kwargs)


def _symbolic_trace(template: Template, fn, flat: list, spec):
    """See :func:`_symbolic_pass`; run isolated from the caller's dispatch modes (a memory
    counter must not see the stand-in arguments either)."""
    with _isolated():
        return _symbolic_pass(template, fn, flat, spec)


def _symbolic_mode():
    """(ShapeEnv, FakeTensorMode on it) for a symbolic pass."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv(duck_shape=False)  # one symbol per size: equal lengths by chance stay apart
    return env, FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)


def _symbolic_tensor(mode, t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as a fake tensor of ``mode`` whose every size and stride is a symbol of its own."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    return mode.from_tensor(t, source=ConstantSource(name),
                            symbolic_context=StatelessSymbolicContext([DimDynamic.DYNAMIC] * t.dim()))


def _symbolic_pass(template: Template, fn, flat: list, spec):
    """Runs ``fn`` on fake tensors with symbolic sizes under the recorder. The hints are the
    template's sizes, so that the symbolic pass takes the template's path and its guards say
    where that path holds (``flat``: this call's arguments, of the same structure).
    A size int is given the template's value as its hint, under a symbol of its own.
    Returns (graph, shape_env, {symbol: (kind, flat index, dim)}, argument checks); a size
    int's source is ("int", flat index, None)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env, mode = _symbolic_mode()
    sources, checks, fake = {}, [], []
    for i, x in enumerate(flat):
        if is_size_int(x):
            value = template.geometry[i]
            sym = env.create_symbol(value, ConstantSource(f"gradaccel_int{i}"), dynamic_dim=DimDynamic.DYNAMIC)
            n = env.create_symintnode(sym, hint=value)
            sources.setdefault(sym, ("int", i, None))
            checks.append(("int", i, None, n))  # an equality the pass found (n == a size) is kept
            fake.append(n)
            continue
        if not isinstance(x, torch.Tensor):
            fake.append(x)
            continue
        # A fresh tensor of the template's geometry (not a view of something bigger, offset 0).
        shape, stride = template.geometry[i]
        f = _symbolic_tensor(mode, torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device),
                             f"gradaccel_arg{i}")
        if x.requires_grad:
            f.requires_grad_(True)
        for kind, values in (("size", f.shape), ("stride", f.stride())):
            for d, v in enumerate(values):
                e = v.node.expr if isinstance(v, torch.SymInt) else None
                if e is not None and e.is_Symbol:
                    sources.setdefault(e, (kind, i, d))
                checks.append((kind, i, d, v))
        fake.append(f)
    graph = _SymbolicGraph(fake, template.graph.preserve_rng_state, mode)

    def pack(t):
        graph.add_pack(t)
        return t

    args, kwargs = tree_unflatten(fake, spec)
    with mode, _backports(), saved_tensors_hooks(pack, lambda t: t), _SymbolicRecorder(graph, template.graph):
        out = fn(*args, **kwargs)
    graph.finish(out)
    return graph, env, sources, checks


@functools.cache
def sizes_matmul() -> bool:
    """Whether the symbolic pass keeps a matmul's sizes symbolic: True on the torch range
    gradaccel supports (2.11 on). Before 2.13, torch's own C++ matmul reads them as ints, so there
    the pass runs gradaccel/recompute/backports.py's copy of it. Where False (a torch whose
    matmul changed its ops), a region with a batched matmul (attention's ``q @ k^T``, a
    ``Linear`` without bias on 3-d input) has no formulas and is traced per size (correct, not
    sized)."""
    return _keeps_sizes(_backports())


@functools.cache
def _torch_matmul_pins_sizes() -> bool:
    """Whether torch's own C++ matmul reads symbolic sizes as ints (before torch 2.13)."""
    return not _keeps_sizes(contextlib.nullcontext())


@contextlib.contextmanager
def _backports():
    """What the symbolic pass needs of torch 2.13, where this torch lacks it (backports.py)."""
    with python_matmul() if _torch_matmul_pins_sizes() else contextlib.nullcontext(), parameter_subclasses():
        yield


def _keeps_sizes(backports) -> bool:
    """Whether a batched and a folded product (3-d @ 3-d, 3-d @ 2-d) keep their sizes symbolic
    with ``backports`` (a context) on."""
    env, mode = _symbolic_mode()
    x = _symbolic_tensor(mode, torch.empty(2, 3, 4), "gradaccel_probe")
    try:
        with mode, backports:
            x @ x.transpose(1, 2)
            x @ x[0].T
    except RuntimeError:  # torch 2.11's folded path: "Cannot call numel() on tensor with symbolic sizes"
        return False
    return not any(v.is_number for v in env.replacements.values())


def analyse(template: Template, fn, flat: list, spec):
    """The :class:`Formulas` of ``template`` from a symbolic pass at the sizes of ``flat``, or
    None where the region cannot be sized by formulas (see the module docstring); then
    ``template.why`` says why."""
    graph = template.graph
    if graph.dynamic or not isinstance(graph.cost, str) and not callable(graph.cost) or graph.cost == "measured":
        template.why = "its costs are measured per call (cost='measured')"
        return None
    if any(isinstance(x, torch.Tensor) and x.storage_offset() != 0 for x in flat):
        template.why = "an argument is a view at a non-zero offset"
        return None
    if _engine.active():  # and reading one there would start a collective on this rank alone
        template.why = "an engine shards its parameters (DeepSpeed ZeRO-3): outside their modules' hooks they are released"
        return None
    state = _attributes(fn)
    try:
        sym_graph, env, sources, checks = _symbolic_trace(template, fn, flat, spec)
        sym_graph.take_externals()  # the fake parameters: nothing needs them past the pass
        formulas = Formulas(sym_graph, env, sources, checks)
    except Exception as exc:  # a data-dependent read, an op without a meta kernel, a printer gap: trace per size
        template.why = _failure(exc)
        return None
    finally:
        rebound = _put_back(state)
    if rebound:
        template.why = "its Python sets attributes of its modules (state the symbolic pass cannot replay)"
        return None
    why = []
    if not formulas.matches(graph, template.geometry, why):
        template.why = f"its run on symbolic sizes differs from its trace ({why[0]})"
        return None
    formulas.template = graph
    return formulas


def _failure(exc: Exception) -> str:
    """Why a symbolic pass failed, for a user: an op with no fake kernel is named."""
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    if isinstance(exc, UnsupportedOperatorException):
        return f"{exc.func} has no fake (meta) kernel: register one with torch.library.register_fake"
    text = str(exc).strip().splitlines()
    return f"its run on symbolic sizes failed: {type(exc).__name__}: {text[0][:200] if text else ''}"


def _attributes(fn) -> list:
    """What the region's module (and its submodules) hold as attributes, before the pass."""
    root = getattr(fn, "__self__", fn)
    if not isinstance(root, torch.nn.Module):
        return []
    return [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in root.modules()]


def _put_back(state: list) -> bool:
    """Undoes what the pass bound on the modules (a cache or statistic it set to a fake tensor
    would be read by the real forward). Returns whether it bound anything: the region's Python
    then writes state, and is traced per size. Mutations inside objects are not seen."""
    rebound = False
    for m, *dicts in state:
        for saved, now in zip(dicts, (m.__dict__, m._parameters, m._buffers, m._modules)):
            if now.keys() != saved.keys() or any(now[k] is not v and not _same_plain(now[k], v)
                                                 for k, v in saved.items()):
                rebound = True
                now.clear()
                now.update(saved)
    return rebound


def _same_plain(a, b) -> bool:
    """An attribute set again to an equal number or string (``self.scale = d ** -0.5``) is no change."""
    return type(a) is type(b) and type(a) in (int, float, bool, str) and a == b


# -- formulas ----------------------------------------------------------------------------------
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

