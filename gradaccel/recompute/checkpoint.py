"""``gradaccel.checkpoint``: activation checkpointing that keeps what fits a memory budget.

How it works, per region (a callable) and input signature:

1. The first call runs the real forward as a full recompute (every saved activation that can
   be rebuilt is dropped, so the budget holds from the first step) while a dispatch mode
   records its aten ops, the bytes of every storage and what autograd saves
   (gradaccel/recompute/trace.py). At its end the C++ planner picks what to keep (gradaccel/recompute/plan.py).
2. Later calls run the forward with no dispatch mode at all: a saved-tensor pack hook keeps,
   drops or (``offload=True``) sends to host memory the k-th saved tensor as the plan says
   (gradaccel/recompute/frames.py). That hook is the whole per-call overhead.
3. Backward unpacks a dropped tensor: the frame replays only the recorded ops that the dropped
   tensors need, from kept tensors and inputs, and hands each one back.

A region whose trace reads data into Python (``.item()``, data-dependent shapes) cannot be
replayed from a trace. If that op ran in a submodule, the submodule is split off: it runs as its
own ``torch.utils.checkpoint`` inside the region, which is traced again and planned. Otherwise
later calls use ``torch.utils.checkpoint`` (or keep all, if it fits). Either is warned about,
naming the op. A backward inside the forward (a gradient penalty) replays what it unpacks.
"""

import math
import types
import warnings

import torch
import torch.utils.checkpoint as _tc
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from gradaccel.recompute import compiled
from gradaccel.recompute import region as _region
from gradaccel.recompute import structure as _structures
from gradaccel.recompute.block_plan import plan_of
from gradaccel.recompute.cost import OpCost, check_cost
from gradaccel.recompute.frames import TraceFrame
from gradaccel.recompute.offload_frame import store_for
from gradaccel.recompute.plan import capture_rng
from gradaccel.recompute.region import (Region, module_names, region_name, remember, retire, run_dynamic, run_planned,
                                        run_sized, split_region, unwrap)
from gradaccel.recompute.report import describe as _describe
from gradaccel.recompute.report import plan_report, plan_rows
from gradaccel.recompute.split_off import active, module_stack
from gradaccel.recompute.state import STATE
from gradaccel.recompute.state import warn_once as _warn_once
from gradaccel.recompute.structure import is_plain as _plain  # the name the key functions below use
from gradaccel.recompute.symbolic import in_fake_pass
from gradaccel.recompute.storage import storage_key
from gradaccel.recompute.trace import DataReads, Graph

__all__ = ["checkpoint", "checkpoint_sequential", "plan_report", "plan_rows", "reset_plans", "OpCost"]

# torch.utils.checkpoint's own options, with their defaults: a call that sets one to anything
# else runs as torch.utils.checkpoint, which implements it (warned once).
_TORCH_ONLY_KWARGS = {"context_fn": _tc.noop_context_fn, "determinism_check": "default", "debug": False,
                      "early_stop": True}


def _check_budget(budget, warn=True):
    """``None``/``0.0``; a float in (0, 1]; a non-negative ``int`` of bytes. Else ValueError.
    ``warn``: where the user wrote the budget (not a share that ``memory=`` chose)."""
    if budget is None:
        return 0.0
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget must be None, a float in [0, 1] or an int number of bytes, got {budget!r}")
    if isinstance(budget, float) and (math.isnan(budget) or not 0.0 <= budget <= 1.0):
        raise ValueError(f"budget as a fraction must lie in [0, 1], got {budget!r}")
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"budget in bytes must be >= 0, got {budget!r}")
    if warn and isinstance(budget, int) and 0 < budget < 1024 and budget not in _WARNED_SMALL:
        # budget=1 reads like "everything" but an int is bytes: say so once, loudly.
        _WARNED_SMALL.add(budget)
        warnings.warn(f"budget={budget!r} is an int, so it means {budget} bytes per region (keep almost "
                      "nothing), not a fraction; write a float for a fraction (budget=1.0 keeps everything)", UserWarning,
                      stacklevel=3)
    return budget


_WARNED_SMALL = set()




def reset_plans() -> None:
    """Forgets every trace and plan (and which warnings were given): each region is traced
    again on its next call. Idle host buffers of ``offload=True`` go back to the system."""
    STATE.reset()


def _owner(fn):
    """What a plan is cached on: the bound object (a module) and function, or the callable."""
    bound = getattr(fn, "__self__", None)
    if bound is not None and not isinstance(bound, types.ModuleType):
        # A builtin bound method (tensor.exp) has no __func__: its name tells it from its siblings.
        return bound, getattr(fn, "__func__", None) or fn.__name__
    return fn, None


def _module_state(m: torch.nn.Module) -> tuple:
    """What a trace of a module depends on beyond its inputs: each submodule's training flag and
    plain attributes (``nn.Dropout.p``, ``eps``), and which parameters and buffers it holds (a
    replaced one must not be read from the old trace) and which parameters are frozen.
    Objects it reaches otherwise (a config object, a ``functools.partial``) are not covered."""
    state, stack, seen = [], [m], {id(m)}
    while stack:  # m.modules() and m.parameters() without their generators: a third of the time
        sub = stack.pop()
        # .training among them; of a block's plan, what a trace depends on: not its budget, which
        # is keyed as the budget (a plan input, not a trace input: memory= sets another one at each
        # length), nor memory='s note that lengths will vary (set at the second length: a trace
        # then finds its size formulas, and is not made again).
        state.extend(v for k, v in sub.__dict__.items() if _plain(v) and k != "_gradaccel_lengths")
        plan = plan_of(sub)
        if plan is not None:
            state.append(plan.traced)
        state.extend((id(p), p.requires_grad) for p in sub._parameters.values() if p is not None)
        state.extend(id(b) for b in sub._buffers.values() if b is not None)
        for child in sub._modules.values():
            if child is not None and id(child) not in seen:  # shared submodules, cycles
                seen.add(id(child))
                stack.append(child)
    return tuple(state)


def _closure_state(fn: types.FunctionType) -> tuple:
    """For a plain function: the tensors, modules and plain values it closes over or names as
    globals, so that a rebound tensor, a frozen layer or a changed constant is another trace."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            pass
    names = fn.__globals__
    values.extend(names[n] for n in fn.__code__.co_names if n in names)
    state = []
    for v in values:
        if isinstance(v, torch.Tensor):
            state.append((id(v), v.requires_grad))
        elif isinstance(v, torch.nn.Module):
            state.append((id(v), _module_state(v)))
        elif _plain(v):
            state.append(v)
    return tuple(state)


def _signature(func, flat, spec, budget, preserve, owner) -> tuple:
    # type(budget): 1 (one byte) and 1.0 (everything) are equal, and hash alike, in Python.
    parts = [func, spec, type(budget), budget, preserve]
    if isinstance(owner, torch.nn.Module):
        parts.append(_module_state(owner))
    elif isinstance(owner, types.FunctionType):
        parts.append(_closure_state(owner))
    storages: dict = {}
    for x in flat:
        if isinstance(x, torch.Tensor):
            # Replay reads an argument's storage with the traced strides and offset, and two
            # arguments that shared a storage in the trace are one storage there.
            alias = storages.setdefault(storage_key(x), len(storages))
            # Geometry in a tuple of its own: a structure's key leaves it out (structure.without_sizes).
            parts.append(((x.shape, x.stride(), x.storage_offset()), alias, x.dtype, x.device, x.requires_grad))
        elif _plain(x):
            parts.append((type(x), x))
        elif isinstance(x, torch.nn.Module):
            parts.append((type(x), id(x), _module_state(x)))
        else:
            parts.append((type(x), id(x)))
    for kind in ("cpu", "cuda"):
        parts.append((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))
    return tuple(parts)


# -- the public API ----------------------------------------------------------------------------
def checkpoint(function, *args, budget=None, preserve_rng_state=True, use_reentrant=None, offload=False,
               host_budget=None, cost="flops", **kwargs):
    """Drop-in for ``torch.utils.checkpoint.checkpoint`` that keeps what fits ``budget``.

    Outputs and gradients equal those of ``function(*args, **kwargs)`` without checkpointing.
    Inside the region, the activations worth keeping (most recompute cost per byte) are kept
    within the budget, and only the ops needed to rebuild the rest are replayed in backward.

    Args:
        function: the region, e.g. a transformer block. Plans are cached per callable and input
            signature (tensor shapes, dtypes, strides, offsets and aliasing; autocast state;
            non-tensor arguments; a module's training flags, scalar attributes and parameters):
            pass a stable callable (a module, a method of one), not a lambda made anew for
            every call. A plain function's closure and global tensors and modules are part of
            the signature; after changing state reached otherwise, call :func:`reset_plans`.
        *args, **kwargs: passed to ``function``.
        budget: ``None`` or ``0.0``: keep nothing (``torch.utils.checkpoint``'s memory); a float
            in ``(0, 1]``: the fraction of the activation bytes the region holds without
            checkpointing that may be kept; an ``int``: that many bytes.
        preserve_rng_state: replay random ops (dropout) with the generator state of the forward.
            If False, their results are kept instead of recomputed.
        use_reentrant: accepted for compatibility; ``True`` is warned about once and the
            non-reentrant path is used.
        offload: let activations that do not fit ``budget`` go to (pinned) host memory instead
            of being recomputed, each one only where the planner's cost model, with copy speeds
            measured once per process, finds the copy cheaper than its recompute. Copies run on
            a side stream; backward brings them back ahead of need.
        host_budget: with ``offload``, the most bytes of host memory the store may hold
            (``None``: no bound). Past it, tensors are recomputed instead (warned once).
        cost: what replaying an op costs, for the planner to minimise. Each op is priced once,
            in the call that traces the region, and the price stays with the plan (``cost`` is
            part of the plan's cache key):

            - ``"flops"`` (default): a roofline estimate, the op's FLOPs (torch's formulas) plus
              the bytes it reads and writes times the machine balance (8 FLOPs a byte on CPU,
              100 on CUDA). Offload's copies: their measured time in the same units.
            - ``"measured"``: the op's time in the traced call, in seconds (wall clock on CPU;
              on CUDA, synchronised around each op, which slows that one call only). Offload's
              copies: seconds per byte of a round trip, from measured copy speeds.
            - a callable ``cost(op) -> float``: ``op`` is a frozen
              :class:`gradaccel.checkpoint.OpCost` with ``name`` (``"aten.mm.default"``),
              ``flops``, ``bytes`` (read and written) and ``device`` (of its first tensor
              argument; CPU for an op with none). It must return a finite float ``>= 0``. With
              ``offload``, it is also called once with ``name="gradaccel.offload"``, ``flops=0``
              and ``bytes=2**20``: the cost of sending that many bytes to host memory and back.
              Pass the same callable on every call (a new lambda each time traces anew).

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: ``budget`` is negative, above 1.0 as a fraction, NaN, a bool or not a number;
            ``offload`` is not a bool; ``host_budget`` is not None or an int >= 0; ``cost`` is
            a string other than ``"flops"``/``"measured"``, or a callable ``cost`` returned
            a negative, NaN, infinite or non-number value.
        TypeError: ``cost`` is neither a string nor a hashable callable.
    """
    _check_budget(budget)
    return _checkpoint(function, args, kwargs, budget, preserve_rng_state, use_reentrant, offload, host_budget, cost)


def _checkpoint(function, args, kwargs, budget, preserve_rng_state=True, use_reentrant=None, offload=False,
                host_budget=None, cost="flops"):
    """:func:`checkpoint`, for callers that checked ``budget`` where it was set (checkpoint_blocks'
    blocks): a small int budget chosen by ``memory=`` is not warned about as if the user wrote it."""
    if torch.compiler.is_compiling() and not offload and not any(k in kwargs for k in _TORCH_ONLY_KWARGS):
        # Under torch.compile: the region's plan as a selective-checkpoint policy, in the graph
        # (gradaccel/recompute/compiled.py), planned while dynamo traces. Else eagerly below (a graph break).
        budget = _check_budget(budget, warn=False)
        if budget == 0 or not torch.is_grad_enabled():
            return compiled.run(function, args, kwargs, compiled.RECOMPUTE_ALL, preserve_rng_state)
        fn, flat_args, flat_kwargs = unwrap(function, args, kwargs)
        owner, func = compiled.owner_of(fn, flat_args)
        compiled.prepare(fn, flat_args, flat_kwargs, owner, func, budget, preserve_rng_state, cost)
        policy = compiled.find(owner, func, budget, preserve_rng_state, cost)
        if policy is not None:
            return compiled.run(function, args, kwargs, policy, preserve_rng_state)
    return _checkpoint_eager(function, args, kwargs, budget, preserve_rng_state, use_reentrant, offload, host_budget,
                             cost)


@torch._disable_dynamo  # dynamo cannot trace what follows: a compiled caller breaks its graph here
def _checkpoint_eager(function, args, kwargs, budget, preserve_rng_state=True, use_reentrant=None, offload=False,
                      host_budget=None, cost="flops"):
    budget = _check_budget(budget, warn=False)
    cost = check_cost(cost)
    if in_fake_pass():  # the region around it runs on symbolic fake tensors: no plans here
        return function(*args, **kwargs)
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be True or False, got {offload!r}")
    if host_budget is not None and (isinstance(host_budget, bool) or not isinstance(host_budget, int) or host_budget < 0):
        raise ValueError(f"host_budget must be None or an int >= 0 (bytes), got {host_budget!r}")
    if use_reentrant:
        _warn_once("reentrant", "gradaccel.checkpoint: use_reentrant=True is not supported; "
                                "the non-reentrant implementation is used.")
    torch_only = {k: kwargs.pop(k) for k in _TORCH_ONLY_KWARGS if k in kwargs}
    changed = sorted(k for k, v in torch_only.items() if v is not _TORCH_ONLY_KWARGS[k] and v != _TORCH_ONLY_KWARGS[k])
    if changed and (budget != 0 or offload):
        _warn_once(("torch_only", tuple(changed)),
                   f"gradaccel.checkpoint: {', '.join(changed)} is an option of torch.utils.checkpoint only: the "
                   "region runs as torch.utils.checkpoint (whole-region recompute, budget unused). Leave it at "
                   "its default for a selective plan.")
    if (budget == 0 and not offload) or changed or not torch.is_grad_enabled():
        return _tc.checkpoint(function, *args, use_reentrant=False,
                              preserve_rng_state=preserve_rng_state, **torch_only, **kwargs)
    fn, args, kwargs = unwrap(function, args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    owner, func = _owner(fn)
    key = _signature(func, flat, spec, budget, preserve_rng_state, owner) + (offload, host_budget, cost)
    try:
        # A tensor's == is elementwise, so it cannot key a dict: its methods are traced every call.
        regions = {} if isinstance(owner, torch.Tensor) else STATE.regions.setdefault(owner, {})
    except TypeError:  # not weak-referenceable: trace every call (correct, slower)
        regions = {}
    region = regions.pop(key, None)
    if region is not None:
        regions[key] = region  # most recently used last: the cache drops from the front
        region.calls += 1
        if region.structure is not None:
            region.structure.planned += 1
        if region.plan is None:
            return run_dynamic(region, fn, args, kwargs, preserve_rng_state)
        if region.plan.externals_alive():
            return run_planned(region, regions, key, fn, args, kwargs, flat)
    store = store_for(host_budget) if offload else None
    structure = _structure(owner, key, cost)
    if structure is not None and region is None and key not in structure.retrace and structure.templates:
        # A new size of a structure seen before: its plan comes from formulas, with no trace.
        graph = structure.sized_graph(fn, flat, spec)
        if graph is not None:
            region = Region(region_name(fn), graph, budget, flat, store)
            region.structure = structure
            if region.plan.externals_alive():
                out = run_sized(region, regions, key, fn, args, kwargs, flat)
                compiled.remember(owner, func, budget, preserve_rng_state, cost, region.plan)
                return out
    out = _run_traced(regions, key, fn, args, kwargs, flat, budget, preserve_rng_state, store, cost, structure)
    region = regions.get(key)
    if region is not None and not offload:  # its plan, for the next compiled call of the region
        compiled.remember(owner, func, budget, preserve_rng_state, cost, region.plan)
    return out


def _structure(owner, exact_key, cost):
    """The :class:`gradaccel.recompute.structure.Structure` of this call: its signature without sizes.
    None where plans are not shared across sizes (a tensor's method; costs measured per call)."""
    if isinstance(owner, torch.Tensor) or isinstance(cost, str) and cost == "measured":
        return None
    try:
        shapes = STATE.shapes.setdefault(owner, {})
    except TypeError:  # not weak-referenceable: traced every call anyway
        return None
    key = tuple(_structures.without_sizes(p) for p in exact_key)
    # A trace does not depend on the budget or its type (the plan does): memory= and fit set a
    # budget per block and length, in bytes or as a share, and each must be sized from the same
    # structure (and the layers share their kind's formulas), not traced anew.
    key = key[:2] + (None, None) + key[4:]
    structure = _structures.structures_of(shapes, key)
    if structure.kind is None and isinstance(owner, torch.nn.Module):
        # Layers of one model share size formulas: the key with the module's kind for its state.
        structure.kind = (type(owner), key[:5], _structures.module_kind(owner), key[6:])
    return structure


def _run_traced(regions, key, fn, args, kwargs, flat, budget, preserve_rng_state, store, cost, structure=None):
    graph = Graph(flat, preserve_rng_state, cost)
    devices = {t.device for t in flat if isinstance(t, torch.Tensor)}
    rng = capture_rng(devices) if preserve_rng_state else None
    frame = TraceFrame(graph, flat, rng)
    graph.module_names = module_names(fn)
    with saved_tensors_hooks(frame.pack, frame.unpack), active(frame), module_stack(graph.module_stack), \
            DataReads(graph), frame.recorder:
        out = fn(*args, **kwargs)
    frame.finish(out)
    name = region_name(fn)
    region = Region(name, graph, budget, flat, store)
    retire(regions.pop(key, None))
    if graph.dynamic:
        if split_region(region, owner=_owner(fn)[0]):
            return out  # traced again, with the submodule split off, on the next call
        _warn_once(("fallback", name, graph.dynamic_reason),
                   f"gradaccel.checkpoint: {name} falls back to torch.utils.checkpoint (the whole region is "
                   f"recomputed in backward unless its budget holds all of it): its forward runs "
                   f"{_describe(graph.dynamic_reason)}, which depends on tensor values, so a trace of it cannot "
                   "be replayed. Move that op out of the checkpointed region to get a selective plan.")
    regions[key] = region
    if structure is not None and not graph.dynamic:
        region.structure = structure
        structure.retrace.discard(key)
        structure.add(graph, flat)
        if getattr(_owner(fn)[0], "_gradaccel_lengths", False):  # lengths will vary: formulas now
            structure.prepare(fn, flat, tree_flatten((args, kwargs))[1])
        if structure.traces > _structures.MAX_TEMPLATES:
            why = structure.why or ("the region's path depends on its input sizes in a way its size formulas "
                                    "cannot follow (a branch on the length, a number computed from a size and "
                                    "passed as a float)")
            _warn_once(("restructured", name),
                       f"gradaccel.checkpoint: {name} was traced {structure.traces} times for one structure (the "
                       f"same ops at other sizes), and each trace runs as a full recompute. Its plans are not sized "
                       f"from formulas because {why}. Pad to a few lengths, or move that code out of the region.")
    if len(regions) > _region.MAX_PLANS:  # a key that moves every call must not grow the cache without end
        retire(regions.pop(next(iter(regions))))
        if sum(not getattr(r, "sized", False) for r in regions.values()) >= _region.MAX_PLANS:
            _warn_once(("retraced", name),
                       f"gradaccel.checkpoint: {name} was traced for more than {_region.MAX_PLANS} signatures, and "
                       "each "
                       "new one runs as a full recompute: something it reads changes on every call (a new tensor "
                       "it closes over, a counter attribute, a NaN): pass such tensors as arguments.")
    remember(region)
    return out


def checkpoint_sequential(functions, segments, input, use_reentrant=None, *, budget=None, preserve_rng_state=True,
                          cost="flops"):
    """Same signature and results as ``torch.utils.checkpoint.checkpoint_sequential`` (its
    positional order: ``use_reentrant`` fourth), each segment checkpointed with ``budget``
    (keyword-only; the last segment, as in torch, is not checkpointed).

    Args:
        functions: an ``nn.Sequential`` or a list of modules/functions, run in order.
        segments: how many chunks to split ``functions`` into.
        input: the input of the first function.
        use_reentrant, budget, preserve_rng_state, cost: as for :func:`checkpoint`.

    Returns:
        The output of the last function.
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    segment_size = len(functions) // segments
    end = -1
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size - 1
        input = checkpoint(_run_segment, input, *functions[start:end + 1], budget=budget,
                           use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state, cost=cost)
    return _run_segment(input, *functions[end + 1:])


def _run_segment(x, *functions):
    """A run of functions as one region. The functions are arguments, so the plan is cached
    on this one function and keyed by which functions (and, for modules, training mode)."""
    for f in functions:
        x = f(x)
    return x
