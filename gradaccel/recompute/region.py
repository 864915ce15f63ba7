"""A region of ``gradaccel.checkpoint``: one callable at one input signature, its plan, and its calls.

gradaccel/recompute/checkpoint.py keys each call, traces the first call of a signature and makes
its :class:`Region`; this module holds the region, its plan (:func:`plan_graph`: the C++ planner
at the region's budget, with offload or without) and how its later calls run: planned
(:func:`run_planned`: a frame keeps, drops or offloads each saved tensor as the plan says), planned
from size formulas (:func:`run_sized`), or, for a region whose trace reads tensor data,
``torch.utils.checkpoint`` (:func:`run_dynamic`). A region whose data-dependent op ran in a
submodule has that submodule split off (:func:`split_region`).

:func:`trace_call` and :func:`plan_graph` are what the memory planner (gradaccel/memory/) uses to
trace a block and plan it at any budget, with ``gradaccel.checkpoint``'s own code.
"""

import functools
import weakref

import torch
import torch.utils.checkpoint as _tc
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from gradaccel.recompute.frames import Frame, TraceFrame
from gradaccel.recompute.offload_frame import OffloadFrame
from gradaccel.recompute.plan import Plan, Planner, capture_rng, copy_device, offload_cost_per_byte, rng_state_bytes
from gradaccel.recompute.report import describe as _describe
from gradaccel.recompute.split_off import active, split_off
from gradaccel.recompute.state import STATE, warn_once
from gradaccel.recompute.trace import DataReads, Graph

class Region:
    """A traced region, its plan and counters, for one callable and one input signature."""

    def __init__(self, name: str, graph: Graph, budget, flat_args: list, store=None, planner: Planner | None = None):
        self.name = name
        self.store = store
        self.graph = graph
        self.budget = budget
        self._tensors = [(t.shape, t.dtype) for t in flat_args if isinstance(t, torch.Tensor)]
        self.calls = 1
        self.plan: Plan | None = None
        self.structure = None  # its signature without sizes (gradaccel/recompute/structure.py), where plans are sized
        if not graph.dynamic:
            self.plan = plan_graph(graph, budget, planner=planner, offload=store is not None, name=name)

    @property
    def signature(self) -> str:
        """The tensor arguments' shapes and dtypes, for reports (plan_rows)."""
        return ", ".join(f"{tuple(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in self._tensors)

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes (what ``budget`` means: see :func:`gradaccel.checkpoint`)."""
        return _in_bytes(self.budget, self.graph)


def plan_graph(graph: Graph, budget, *, planner: Planner | None = None, offload: bool = False,
               name: str = "region") -> Plan:
    """The plan ``gradaccel.checkpoint`` makes for a traced region at ``budget``.

    Args:
        graph: the region's trace (:func:`trace_call`, or a traced call's), not dynamic.
        budget: as :func:`gradaccel.checkpoint`'s: a fraction of the activation bytes (float) or
            bytes (int).
        planner: ``Planner(graph)`` made once for many budgets (made here if None).
        offload: whether what the budget leaves out may go to host memory, where the copy (priced
            at this machine's measured copy speed) costs less than its recompute.
        name: the region's name, for the warning given once where the plan does not fit.

    Returns:
        Plan: what is kept, dropped (replayed) and offloaded.
    """
    planner = planner or Planner(graph)
    copy_cost = None
    if offload:
        copy_cost = offload_cost_per_byte(copy_device(graph), graph.cost)
    # The saved generator state is held by the region too: it counts against the budget
    # where replay draws random numbers (read only then: a traced device may be fake).
    plan = planner.plan(_in_bytes(budget, graph), copy_cost, rng_state_bytes(graph) if planner.random else 0)
    if not plan.fits:
        warn_once(("fits", name),
                  f"gradaccel.checkpoint: {name} keeps {plan.kept_bytes} bytes, over its budget of "
                  f"{plan.budget_bytes}: it saves tensors that cannot be recomputed (ops that update "
                  "state, such as batch norm's running statistics, RNN kernels, or a submodule split off "
                  "as its own torch.utils.checkpoint and random ops after it). Raise the budget for "
                  "this region.")
    return plan


def trace_call(forward, args: tuple, kwargs: dict, preserve_rng_state: bool = True, cost="flops"):
    """Runs ``forward(*args, **kwargs)`` as the first call of a ``gradaccel.checkpoint`` region does:
    recorded op by op, every saved tensor that can be rebuilt dropped (a full recompute).

    Args:
        forward: the region (a block's forward, bound).
        args, kwargs: its arguments.
        preserve_rng_state: replay random ops with the generator state of this call.
        cost: the cost model (see :func:`gradaccel.checkpoint`).

    Returns:
        tuple: ``(graph, out)``: the trace (its parameters let go: nothing needs them past it;
        ``graph.dynamic`` where it read tensor data) and what ``forward`` returned, whose
        backward works.
    """
    flat, _ = tree_flatten((args, kwargs))
    graph = Graph(flat, preserve_rng_state, cost)
    devices = {t.device for t in flat if isinstance(t, torch.Tensor)}
    frame = TraceFrame(graph, flat, capture_rng(devices) if preserve_rng_state else None)
    with saved_tensors_hooks(frame.pack, frame.unpack), DataReads(graph), frame.recorder:
        out = forward(*args, **kwargs)
    frame.finish(out)
    graph.take_externals()
    return graph, out


def _in_bytes(budget, graph: Graph) -> int:
    return budget if isinstance(budget, int) else int(budget * graph.activation_bytes)


MAX_PLANS = 64  # signatures (plans) kept per callable; the least recently used goes first


def remember(region) -> None:
    """Adds ``region`` to STATE.in_order (plan_rows' order). Regions dropped from the caches
    die; their references are swept out every MAX_PLANS additions, not at each one (a new
    length adds one per layer, and the list holds up to MAX_PLANS per callable)."""
    STATE.in_order.append(weakref.ref(region))
    if len(STATE.in_order) % MAX_PLANS == 0:
        STATE.in_order[:] = [r for r in STATE.in_order if r() is not None]


def run_sized(region, regions, key, fn, args, kwargs, flat):
    """A call at a new size of a known structure, planned from formulas (gradaccel/recompute/formulas.py)."""
    region.sized = True
    regions[key] = region
    while len(regions) > MAX_PLANS:  # plans per size are cheap to make again: drop the oldest
        retire(regions.pop(next(iter(regions))))
    remember(region)
    return run_planned(region, regions, key, fn, args, kwargs, flat)


def run_planned(region, regions, key, fn, args, kwargs, flat):
    """A call of a planned region: a frame keeps, drops or offloads each saved tensor as the plan
    says. A call that strays from the plan is recomputed whole in backward, the region dropped
    from ``regions`` (traced again next time) and warned about once."""
    plan = region.plan
    rng = capture_rng(plan.graph.devices) if plan.needs_rng or plan.draws else None
    frame = Frame(plan, flat, rng, (fn, args, kwargs)) if region.store is None or not plan.offloaded else \
        OffloadFrame(plan, flat, rng, region.store, (fn, args, kwargs))  # the call: rerun if it strays
    with saved_tensors_hooks(frame.pack, frame.unpack), active(frame):
        out = fn(*args, **kwargs)
    if not frame.finish(out):
        retire(regions.pop(key, None))
        structure = getattr(region, "structure", None)
        if structure is not None:  # sized from formulas that did not hold: trace this size next time
            structure.strayed(key)
        warn_once(("diverged", region.name),
                  f"gradaccel.checkpoint: {region.name} saved different tensors than when it was traced for "
                  f"the same input signature ({frame.divergence}): this call is recomputed whole, and the region "
                  "traced again. Make the region's behaviour depend only on its arguments (and module.training).")
    return out


def split_region(region, owner) -> bool:
    """Where a data-dependent op ran in a submodule of the region (eager MoE experts' ``nonzero``),
    that submodule alone becomes its own ``torch.utils.checkpoint`` and the rest of the region
    gets a selective plan. Returns False where there is no such submodule (plain fallback)."""
    graph = region.graph
    sub = graph.dynamic_module() if graph.dynamic_module is not None else None
    if not isinstance(sub, torch.nn.Module) or sub is owner or not split_off(sub, graph.dynamic_reason):
        return False
    warn_once(("split", region.name, type(sub).__name__),
              f"gradaccel.checkpoint: {region.name}: {type(sub).__name__} runs {_describe(graph.dynamic_reason)}, "
              "which depends on tensor values: that submodule runs as torch.utils.checkpoint (recomputed whole "
              "in backward) and the rest of the region gets a selective plan from its next call.")
    return True


def retire(region) -> None:
    """A region replaced or dropped from its cache: a backward may still hold it, but it is no
    longer the plan, so plan_rows() leaves it out."""
    if region is not None:
        region.retired = True


def module_names(fn) -> dict[int, str]:
    """id -> name of each submodule of the region's module, for the report's op names."""
    root = getattr(fn, "__self__", fn)
    return {id(m): n for n, m in root.named_modules() if n} if isinstance(root, torch.nn.Module) else {}


def run_dynamic(region, fn, args, kwargs, preserve_rng_state):
    """A call of a region whose trace read tensor data: plain autograd where its budget holds it
    all, else ``torch.utils.checkpoint``."""
    if region.budget_bytes >= region.graph.activation_bytes:
        return fn(*args, **kwargs)  # everything fits: plain autograd
    return _tc.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def unwrap(fn, args, kwargs):
    """``functools.partial`` layers folded into the arguments, so the plan is cached on the
    underlying callable and tensors bound in the partial are seen as inputs."""
    while isinstance(fn, functools.partial):
        args = fn.args + tuple(args)
        kwargs = {**fn.keywords, **kwargs}
        fn = fn.func
    return fn, args, kwargs


def region_name(fn) -> str:
    """The region's name in warnings and reports: ``Block.forward``, a module's class, a function's name."""
    bound = getattr(fn, "__self__", None)
    if isinstance(bound, torch.nn.Module):
        return f"{type(bound).__name__}.{getattr(fn, '__name__', 'forward')}"
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", type(fn).__name__)
