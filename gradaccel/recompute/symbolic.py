"""The symbolic pass: a region's Python run once more on fake tensors whose sizes are symbols.

When a structure (gradaccel/recompute/structure.py) is called at a size it has no trace for, its
template's region runs again on fake tensors whose every size and stride is a symbol of its own
(torch's ``ShapeEnv``, never merged by value), under gradaccel's recorder. That gives every
number of the trace as a formula of the input sizes, and the guards: the conditions on the sizes
under which the region takes the same path. :func:`analyse` returns them as
:class:`~gradaccel.recompute.formulas.Formulas` where the symbolic trace matches the template op
for op and gives back its numbers at its sizes, else None with the reason in ``template.why``.

The pass leaves no trace outside (:func:`_isolated`): no outer recorder, generator, warning,
module hook or autocast cache sees it, and attributes it binds on the modules are put back.
"""

import contextlib
import functools
import math
import threading
import warnings

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradaccel.recompute import engine as _engine
from gradaccel.recompute import split_off as _split
from gradaccel.recompute.backports import parameter_subclasses, python_matmul
from gradaccel.recompute.formulas import Formulas, is_size_int
from gradaccel.recompute.trace import Graph, Op, Recorder, Ref, is_foreign

_FAKE_PASS = []  # non-empty while a region's Python runs on symbolic fake tensors


def in_fake_pass() -> bool:
    """True inside the symbolic pass: a nested ``gradaccel.checkpoint`` then runs its function plainly."""
    return bool(_FAKE_PASS)



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


def _symbolic_trace(template, fn, flat: list, spec):
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


def _symbolic_pass(template, fn, flat: list, spec):
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


def analyse(template, fn, flat: list, spec):
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
