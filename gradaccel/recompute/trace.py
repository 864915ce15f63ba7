"""Records what one checkpointed region does, inside its real forward, at the aten level.

The record is a graph of *values*: a storage at one version. Ops read values and create new
storages or write new versions of existing ones (in-place ops). Bytes belong to storages, so
a view costs nothing and aliasing is counted once. Tensor arguments are kept as references
(storage, size, stride, offset, dtype), which is all that replay needs to rebuild them.

Used once per input signature (see gradaccel/recompute/checkpoint.py); later calls run without it.
"""

import dataclasses
import time
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from gradaccel.recompute.context import autocast_keys, autocast_state
from gradaccel.recompute.cost import FLOPS_PER_BYTE, OpCost, price, run_timed  # noqa: F401 (FLOPS_PER_BYTE: fit.py)
from gradaccel.recompute.flops import formula as _table_formula
from gradaccel.recompute.roles import Leaf, Source
from gradaccel.recompute.storage import StorageMap, lazy_bits, storage_key

aten = torch.ops.aten


def _existing(*names: str) -> frozenset:
    """The named aten op packets this torch build has: private ones come and go between releases,
    and a missing one must not make `import gradaccel` fail (it cannot be traced either)."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# Ops that use only the metadata (size, stride, dtype, device) of their tensor argument: replay
# feeds them an uninitialised stand-in, so e.g. dropout's `empty_like(x)` does not pull x in.
_METADATA_ONLY = _existing(
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
)
# Ops that update state they were not handed as mutable (batch norm's running statistics):
# replaying one would update it twice, so their results are kept, never recomputed.
_STATEFUL = _existing(
    "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "cudnn_batch_norm",
    "miopen_batch_norm", "_batch_norm_impl_index",
)
# Ops whose outputs depend on grad mode: replay runs under no_grad, where the RNN kernels
# return no workspace. Their results are kept, never recomputed.
_GRAD_MODE_DEPENDENT = _existing("mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn")
# Ops whose results depend on tensor data (`.item()`, `if tensor:`, data-dependent shapes): a trace
# freezes them as constants, so it cannot be replayed. Ints that restate shapes are fine (shapes key plans).
_DYNAMIC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
# Ops tagged with a dynamic output shape that is static for integer indices: the output takes the
# indices' shape, and replay reads the indices of the call it rebuilds (MoE routing, x[..., [-2]]).
_INDEX_OPS = _existing("index", "_unsafe_index")


@dataclasses.dataclass(frozen=True)
class View:
    """A tensor as replay sees it: a value (a storage at one version) and a view of it."""

    storage: int
    value: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Ref(View):
    """A tensor argument of a recorded op."""

    device: torch.device
    meta_only: bool = False


@dataclasses.dataclass
class Storage:
    nbytes: int
    device: torch.device
    creator: int = -1  # op that allocated it; -1: it existed before the region
    external: Any = None  # before the region: a Leaf, from an argument (ARG) or elsewhere (OBJ)
    versions: list = dataclasses.field(default_factory=list)  # value ids, oldest first


@dataclasses.dataclass
class Op:
    func: Any
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list  # args/kwargs leaves, tensors replaced by Ref
    reads: list  # value ids this op depends on
    new_storages: list  # (storage id, index of the tensor among the flattened outputs)
    flops: int
    cost: float  # under the graph's cost model (gradaccel/recompute/cost.py)
    replayable: bool
    random: bool
    priced: str = "formula"  # how `flops` was found: "formula", "measured" or "bound"
    module: str = ""  # the submodule of the region that ran it ("mlp.gate_proj"), for reports
    nbytes: int = 0  # bytes it reads and writes (its cost's other term): re-priced at other sizes
    # An op from outside aten and prims (bitsandbytes' gemm_4bit, flash-attn): the autocast it
    # ran under, which replay restores (its own aten ops are cast as in a plain forward), and
    # the dtypes of its tensor outputs (the symbolic pass's fake kernel may not know autocast).
    autocast: tuple = ()
    out_dtypes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Opaque:
    """The ``func`` of an op recorded by :meth:`Graph.record_opaque`."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Pack(View):
    """One tensor autograd saved for backward, in the order autograd saved them."""

    grad_fn: object  # node_kind() of the tensor: tells apart ops that save the same shapes; INPUT
    # for a storage from before the region, whose node is its caller's: a leaf copy of an argument
    # and the argument itself (a non-leaf) are the same input to the region (see same_meta).


class Graph:
    """The trace of one region. See the module docstring."""

    RNG = 0  # storage id of the pseudo-storage random ops read and write (the generator state)
    sized = False  # True for a trace resized from formulas (gradaccel/recompute/formulas.py), not recorded
    shared = None  # a sized trace's: what its kind's planner made at its sizes (recompute/plan.py Shared)

    def __init__(self, flat_args: list, preserve_rng_state: bool, cost="flops"):
        self.cost = cost  # the cost model ops are priced with (see gradaccel.checkpoint)
        self.storages: list[Storage] = []
        self.values: list[tuple[int, int]] = []  # (storage, producer op or -1)
        self.ops: list[Op] = []
        self.packs: list[Pack] = []
        self.outputs: dict[int, int] = {}  # storage -> index among flattened outputs
        self.dynamic = False
        self.dynamic_reason = ""  # the first op (or Python read) that made the trace data dependent
        self.dynamic_module = None  # weak reference to the innermost module that ran it
        self.module_stack: list = []  # modules whose forward is running (kept by hooks while tracing)
        self.in_opaque = 0  # > 0 inside a submodule that runs as its own torch.utils.checkpoint
        self.module_names: dict[int, str] = {}  # id(submodule) -> its name in the region, for reports
        # Set by finish(): the region's activations (storage ids), their bytes, its devices.
        self.activations: list[int] = []
        self.activation_bytes = 0
        self.devices: frozenset = frozenset()
        self.preserve_rng_state = preserve_rng_state
        self.autocast = autocast_state()  # at entry (the plan key holds it): a full recompute runs under it
        self._live = StorageMap()  # live storage -> its id
        self._strong: list = []  # externals, held for the traced call's own backward
        self._new_storage(0, torch.device("cpu"))  # Graph.RNG
        self._args = {}
        for i, t in enumerate(flat_args):
            if isinstance(t, torch.Tensor):
                self._args.setdefault(storage_key(t), i)

    # -- storages and values ---------------------------------------------------------------
    def _new_storage(self, nbytes: int, device, creator: int = -1, external=None) -> int:
        sid = len(self.storages)
        self.storages.append(Storage(nbytes, device, creator, external))
        self._new_value(sid, creator)
        return sid

    def _new_value(self, sid: int, producer: int) -> int:
        vid = len(self.values)
        self.values.append((sid, producer))
        self.storages[sid].versions.append(vid)
        return vid

    def storage_of(self, t: torch.Tensor) -> int:
        """The id of ``t``'s storage; a storage not seen before existed before the region."""
        hit = self._live.get(t)
        if hit is not None:
            return hit
        arg = self._args.get(storage_key(t))
        if arg is not None:
            external = Leaf(Source.ARG, arg)
        else:
            external = Leaf(Source.OBJ, weakref.ref(t))
            self._strong.append(t)
        sid = self._new_storage(t.untyped_storage().nbytes(), t.device, external=external)
        self._live.set(t, sid)
        return sid

    def _created(self, t: torch.Tensor, op: int) -> int:
        sid = self._new_storage(t.untyped_storage().nbytes(), t.device, creator=op)
        self._live.set(t, sid)
        return sid

    def alias(self, t: torch.Tensor, sid: int) -> None:
        """From now on ``t``'s storage is storage ``sid`` (a saved tensor rebuilt by replay)."""
        self._live.set(t, sid)

    def current(self, sid: int) -> int:
        return self.storages[sid].versions[-1]

    def _view_of(self, t: torch.Tensor) -> tuple:
        sid = self.storage_of(t)
        return sid, self.current(sid), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype

    def ref(self, t: torch.Tensor, meta_only: bool = False) -> Ref:
        return Ref(*self._view_of(t), t.device, meta_only)

    # -- recording ---------------------------------------------------------------------------
    def record(self, func, args, kwargs, out, seconds=None, autocast=()) -> None:
        """Records one op; ``seconds``: its time in this call, where measured (see Recorder);
        ``autocast``: for an op outside aten, the autocast it ran under (see :func:`autocast_state`)."""
        op_id = len(self.ops)
        leaves, spec = tree_flatten((args, kwargs))
        meta_only = func.overloadpacket in _METADATA_ONLY
        refs = [self.ref(x, meta_only) if isinstance(x, torch.Tensor) else x for x in leaves]
        reads = [r.value for r in refs if isinstance(r, Ref) and not r.meta_only]
        random = torch.Tag.nondeterministic_seeded in func.tags
        if any(tag in func.tags for tag in _DYNAMIC_TAGS) and not _integer_index(func, args, kwargs):
            self.mark_dynamic(str(func))
        written = self._written_storages(func, args, kwargs)
        replayable = (func.overloadpacket not in _STATEFUL and func.overloadpacket not in _GRAD_MODE_DEPENDENT
                      and all(self.storages[s].creator >= 0 for s in written))
        out_leaves, _ = tree_flatten(out)
        if any(lazy_bits(t) for t in (*leaves, *out_leaves)):
            # A conjugate or negative view: replay sees storages, not these bits. Keep what such
            # ops make, and leave later calls to torch.utils.checkpoint.
            replayable = False
            self.mark_dynamic(f"{func} (a conjugate or negative view)")
        if random:
            reads.append(self.current(Graph.RNG))
            replayable = replayable and self.preserve_rng_state
        known = {r.storage for r in refs if isinstance(r, Ref)}
        new_storages, nbytes = [], sum(_nbytes(r) for r in refs if isinstance(r, Ref))
        for i, o in enumerate(out_leaves):
            if isinstance(o, torch.Tensor):
                nbytes += o.numel() * o.element_size()
                if self._live.get(o) not in known:
                    new_storages.append((self._created(o, op_id), i))
        for s in written:
            self._new_value(s, op_id)
        if random:
            self._new_value(Graph.RNG, op_id)
        # A fake tensor's time is the fake kernel's Python, not the op's: no price.
        on_cpu = all(o.device.type == "cpu" and not isinstance(o, FakeTensor) for o in out_leaves
                     if isinstance(o, torch.Tensor))
        flops, priced = _flops(func, args, kwargs, out, seconds if on_cpu else None)
        device = next((r.device for r in refs if isinstance(r, Ref)), torch.device("cpu"))
        cost = price(self.cost, OpCost(str(func), flops, nbytes, device), seconds)
        foreign = is_foreign(func)
        self.ops.append(Op(func, spec, refs, reads, new_storages, flops, cost, replayable, random, priced,
                           self._where(), nbytes, autocast if foreign else (),
                           tuple(o.dtype for o in out_leaves if isinstance(o, torch.Tensor)) if foreign else ()))

    def _where(self) -> str:
        """The name in the region of the innermost running submodule that has one ("" outside any)."""
        for m in reversed(self.module_stack):
            name = self.module_names.get(id(m))
            if name:
                return name
        return ""

    def mark_dynamic(self, reason: str) -> None:
        """Marks the trace as not replayable on later calls, because of ``reason`` (the first
        one is what a fallback warning names)."""
        if not self.dynamic:
            self.dynamic, self.dynamic_reason = True, reason
            if self.module_stack:
                self.dynamic_module = weakref.ref(self.module_stack[-1])

    def record_opaque(self, name: str, args, kwargs, out) -> None:
        """Records a submodule call that ran as its own ``torch.utils.checkpoint`` as one op that
        replay never runs: what it makes (and anything after it that reads the generator) is
        kept where the plan needs it, like a stateful op's results."""
        op_id = len(self.ops)
        leaves, spec = tree_flatten((args, kwargs))
        refs = [self.ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        reads = [r.value for r in refs if isinstance(r, Ref)] + [self.current(Graph.RNG)]
        new_storages = [(self._created(o, op_id), i) for i, o in enumerate(tree_flatten(out)[0])
                        if isinstance(o, torch.Tensor)]
        self._new_value(Graph.RNG, op_id)  # it may have drawn random numbers
        self.ops.append(Op(Opaque(name), spec, refs, reads, new_storages, 0, 0.0, False, True))

    def _written_storages(self, func, args, kwargs) -> list[int]:
        written = []
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    written.append(self.storage_of(t))
        return written

    def add_pack(self, t: torch.Tensor) -> int:
        if lazy_bits(t):
            self.mark_dynamic("a saved conjugate or negative view")
        view = self._view_of(t)
        pack = Pack(*view, node_kind(t) if self.storages[view[0]].creator >= 0 else INPUT)
        self.packs.append(pack)
        return pack.storage

    def finish(self, out) -> None:
        """Notes which storages the region returns (the caller holds those anyway), and so which
        ones are its activations: created inside, saved for backward, not returned."""
        for i, o in enumerate(tree_flatten(out)[0]):
            if isinstance(o, torch.Tensor):
                hit = self._live.get(o)
                if hit is not None:
                    self.outputs.setdefault(hit, i)
        self._live.clear()
        packed = {p.storage for p in self.packs}
        self.activations = [s for s in sorted(packed) if self.storages[s].creator >= 0 and s not in self.outputs]
        self.activation_bytes = sum(self.storages[s].nbytes for s in self.activations)
        self.devices = frozenset(s.device for s in self.storages)

    def take_externals(self) -> list:
        """Hands over the strong references to tensors read from outside the arguments: the
        traced call's frame holds them until its backward; the cached graph keeps weak ones."""
        strong, self._strong = self._strong, []
        return strong

    # -- queries -----------------------------------------------------------------------------
    def is_leaf_value(self, vid: int) -> bool:
        """A value replay can take as it is, when its storage is at hand (its final version;
        for the generator, its state at entry)."""
        sid, _ = self.values[vid]
        if sid == Graph.RNG:
            return vid == self.storages[sid].versions[0]
        return vid == self.storages[sid].versions[-1]


def _integer_index(func, args, kwargs) -> bool:
    """An indexing op whose indices are all integer tensors (no boolean mask): its output shape
    is the indices' shape, not data dependent."""
    if func.overloadpacket not in _INDEX_OPS:
        return False
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return all(i is None or (isinstance(i, torch.Tensor) and not i.dtype.is_floating_point
                             and i.dtype not in (torch.bool, torch.uint8)) for i in indices)


INPUT = "input"  # Pack.grad_fn of a saved tensor whose storage existed before the region


def same_meta(t: torch.Tensor, pack: Pack) -> bool:
    """Whether ``t`` may be the tensor the trace saw saved as ``pack``: its dtype, shape and, for
    a tensor the region made, the kind of autograd node that made it. Not for a tensor from before
    the region (an argument): which node made it is the caller's business, not the region's, and
    planning on leaf copies of the arguments must hold for the arguments themselves."""
    return t.dtype == pack.dtype and t.shape == pack.size and (pack.grad_fn is INPUT or node_kind(t) == pack.grad_fn)


def node_kind(t: torch.Tensor):
    """The type of autograd node that produced ``t``. Views count as one kind: which view node
    reshape records differs with a dispatch mode active (``ViewBackward0`` under the tracer,
    ``ReshapeAliasBackward0`` without), and the trace must match the calls that run without."""
    return "view" if t._is_view() else type(t.grad_fn)


def _nbytes(r: Ref) -> int:
    n = 1
    for d in r.size:
        n *= d
    return n * r.dtype.itemsize


def _flops(func, args, kwargs, out, seconds=None) -> tuple[int, str]:
    """FLOPs of one op and how they were found: torch's formula; else, for an op outside aten
    (bitsandbytes' gemm_4bit, fused Liger or flash-attn kernels, custom ops), its time measured
    in the traced forward (CPU) at this machine's measured matmul rate, or a conservative bound
    (CUDA, where a host timer does not see the kernel). Such an op is never free to recompute."""
    packet = func.overloadpacket
    known = _table_formula(func, args, kwargs)
    if known is not None:
        return _whole(known), "formula"
    if packet in flop_registry:
        try:
            return _whole(flop_registry[packet](*args, **kwargs, out_val=out)), "formula"
        except Exception:  # an overload the counter does not know must not break the forward
            return _flops_bound(args, kwargs, out), "bound"
    if packet is getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None):
        # Not in torch's flop registry: two batched matmuls, QK^T and PV.
        q, k = args[0], args[1]
        return 4 * q.numel() * k.shape[-2], "formula"
    if not is_foreign(func):
        return 0, "formula"  # elementwise and data movement: priced by the bytes they move
    if seconds is not None:
        return max(1, int(seconds * _cpu_flop_rate())), "measured"
    return _flops_bound(args, kwargs, out), "bound"


def _whole(n):
    """``int(n)``, except that a symbolic count (gradaccel/recompute/symbolic.py traces on symbolic sizes)
    stays a formula: ``int()`` would pin its sizes to this call's."""
    return n if isinstance(n, torch.SymInt) else int(n)


def _flops_bound(args, kwargs, out) -> int:
    """An upper-leaning bound for an op of unknown cost: a matmul's, 2 x output elements x the
    longest inner (last) dimension among its tensor inputs (exact for a GEMM, high for the rest)."""
    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    inner = max((t.shape[-1] for t in ins), default=1)
    return max(1, 2 * sum(t.numel() for t in outs) * inner)


_RATE = []


def _cpu_flop_rate() -> float:
    """FLOP/s of a float32 matmul on this CPU, measured once (best of a few, about a millisecond)."""
    if not _RATE:
        a = torch.randn(128, 128)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, a)
            best = min(best, time.perf_counter() - t0)
        _RATE.append(2 * 128 ** 3 / max(best, 1e-9))
    return _RATE[0]


class DataReads(TorchFunctionMode):
    """Flags the trace as data dependent where the region reads tensor data into Python without
    an aten op (``tolist()``, ``numpy()``), which the Recorder cannot see. Only while tracing."""

    _READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})

    def __init__(self, graph: Graph):
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._READS and not self.graph.in_opaque:
            self.graph.mark_dynamic(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def is_foreign(func) -> bool:
    """An op from outside aten and prims: a library's or the user's (``torch.library``)."""
    return getattr(func, "namespace", "aten") not in ("aten", "prims")


class Recorder(TorchDispatchMode):
    """Records every aten op run while it is active into ``graph``."""

    def __init__(self, graph: Graph):
        super().__init__()
        self.graph = graph
        self.paused = False
        self.autocast = ()

    def __enter__(self):
        self.autocast = autocast_state()  # the region caller's, read before the mode excludes it
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") == "prim":
            # Metadata queries (prim.device) that only fake tensors dispatch: no op of the real
            # call, and timing them would price the planner's noise (a fit on fake tensors).
            return func(*args, **kwargs)
        measured = isinstance(self.graph.cost, str) and self.graph.cost == "measured"
        foreign = is_foreign(func)
        if self.paused or (not measured and not foreign):
            out, seconds = func(*args, **kwargs), None
        else:  # an op's time is its cost ("measured"), or prices an op with no FLOP formula (see _flops)
            with autocast_keys(self.autocast if foreign else ()):
                out, seconds = run_timed(func, args, kwargs, sync=measured)
        if not self.paused:
            if foreign:
                out = self.foreign_result(func, out)
            self.graph.record(func, args, kwargs, out, seconds, self.autocast)
        return out

    def foreign_result(self, func, out):
        """What the region gets from an op outside aten (the symbolic pass corrects its dtype)."""
        return out
