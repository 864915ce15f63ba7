"""``gradaccel.checkpoint`` under ``torch.compile``: the plan, carried out by compile.

Eagerly, a region's plan runs through saved-tensor hooks and a replay of gradaccel's own
(gradaccel/recompute/frames.py), which dynamo cannot trace. Under ``torch.compile`` the region
runs instead as ``torch.utils.checkpoint`` with a selective-checkpoint policy made from the
plan: an op whose activations the plan keeps is ``MUST_SAVE``, every other op
``PREFER_RECOMPUTE``. Dynamo turns the call into its checkpoint higher-order op, AOTAutograd
asks the policy about each op of the region and tags its nodes, and the partitioner saves the
tagged outputs that backward needs and recomputes the rest inside the backward graph. So the
compiled graph keeps what the plan keeps, with compile's kernels, and no graph break.

Where a region's plan comes from:

- a budget (``gradaccel.checkpoint(..., budget=)``, ``checkpoint_blocks(model, budget=)``,
  Hugging Face checkpointing through ``gradaccel.hf``): while dynamo traces the region for the
  first time, :func:`prepare` traces it with gradaccel's own tracer and plans it with the same
  planner at the same budget, on fake tensors shaped as dynamo's (``torch._dynamo.comptime``:
  Python that runs at trace time only). The policy is kept on the callable's owner (the
  module), where dynamo reads it and guards on it. A plan made by an eager call of the region
  serves as well. A region that cannot be planned so (it reads tensor data into Python, or its
  arguments cannot be read back) runs eagerly, a graph break, as before compile (warned).
- ``checkpoint_blocks(model, memory=...)``: the target's forward pre-hook runs eagerly (a graph
  break before the model's first op) and plans as in eager mode; under compile it hands each
  block the policy of its plan (its ``BlockPlan.policy``, read by gradaccel/recompute/blocks.py), at
  the longest length the compiled graph serves (gradaccel/memory/target.py).

Policies are interned by content: two plans that keep the same ops are one policy object, so a
new length whose plan keeps what the last one kept passes dynamo's guards and reuses its graph
(with dynamic shapes); only a plan that keeps something else compiles another graph.

The policy is asked about each op as the region runs under AOTAutograd, in order. It matches an
op to the traced one by its name, the rank and dtype of its first tensor argument, and how many
such ops came before it; an op the trace does not have (Hugging Face builds attention masks and
repeats grouped KV heads differently while compiling) is recomputed.
"""

import contextlib
import functools
import types
import warnings

import torch
import torch.utils.checkpoint as _tc
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_map

from gradaccel.recompute.block_plan import plan_of
from gradaccel.recompute.frames import TraceFrame
from gradaccel.recompute.plan import Planner, capture_rng, rng_state_bytes
from gradaccel.recompute.trace import DataReads, Graph, Opaque, Ref

__all__ = ["Policy", "policy_of", "owner_of", "find", "remember", "prepare", "plan_on_fakes", "run", "block_policy",
           "KEEP_ALL", "RECOMPUTE_ALL"]

KEEP_ALL = "keep all"  # the plan keeps every activation: the region runs without a checkpoint
RECOMPUTE_ALL = "recompute all"  # keeps none: plain torch.utils.checkpoint
_TABLE = "_gradaccel_compiled"  # an owner's {(function name, budget type, budget, preserve, cost): policy}
MAX_POLICIES = 256  # interned policies; past it, the oldest are forgotten (the objects live on where held)


def _signature(leaves) -> tuple:
    """The rank and dtype of an op's first tensor argument: what tells apart, say, the view of a
    matmul's output from the view in a repeat of KV heads, at any length. (Not its other
    arguments: attention takes a mask under compile that it does not take eagerly.)"""
    for x in leaves:
        if isinstance(x, Ref):
            return len(x.size), x.dtype
        if isinstance(x, torch.Tensor):
            return x.dim(), x.dtype
    return ()


class Policy:
    """What a plan keeps, op by op, as ``torch.utils.checkpoint``'s selective checkpointing asks
    for it. Immutable and interned (:func:`policy_of`): equal plans give the same object.

    Attributes:
        decisions: ``(op name, rank and dtype of its first tensor argument) -> (keep?, ...)``,
            per occurrence of such an op in the region, in order, up to the last one kept.
    """

    __slots__ = ("decisions",)

    def __init__(self, decisions: tuple):
        self.decisions = dict(decisions)

    def __reduce__(self):  # pickled with a model (torch.save): interned again on load
        return _intern, (tuple(sorted(self.decisions.items(), key=repr)),)

    def __deepcopy__(self, memo):  # immutable: a copied model shares it (and its compiled graphs)
        return self

    def __repr__(self):
        kept = [f"{name}#{i}" for (name, _), keeps in self.decisions.items() for i, k in enumerate(keeps) if k]
        return f"Policy(keeps {', '.join(kept)})"

    def counter(self):
        """A policy function for one run of the region: it counts the ops it is asked about
        (in forward, and again in a recompute, when the region runs as eager selective checkpointing)."""
        counts = ({}, {})
        decisions = self.decisions

        def policy(ctx, func, *args, **kwargs):
            key = (str(func), _signature(tree_flatten((args, kwargs))[0]))
            seen = counts[bool(ctx.is_recompute)]
            i = seen.get(key, 0)
            seen[key] = i + 1
            keeps = decisions.get(key, ())
            if i < len(keeps) and keeps[i]:
                return _tc.CheckpointPolicy.MUST_SAVE
            return _tc.CheckpointPolicy.PREFER_RECOMPUTE

        return policy


_INTERNED: dict = {}
# Norms that inductor decomposes: kept, every node of the decomposition is kept with them, and
# their backward then holds the normalized input as well (a hidden state the plan does not count,
# measured). Recomputed instead, from the region's input: a fused kernel in backward.
_NORMS = frozenset({"aten.native_layer_norm.default", "aten.native_group_norm.default"})


def _intern(decisions: tuple) -> Policy:
    policy = _INTERNED.get(decisions)
    if policy is None:
        policy = _INTERNED[decisions] = Policy(decisions)
        while len(_INTERNED) > MAX_POLICIES:
            _INTERNED.pop(next(iter(_INTERNED)))
    return policy


def policy_of(plan):
    """The policy that keeps what ``plan`` (gradaccel/recompute/plan.py) keeps: :data:`KEEP_ALL`
    where it keeps every activation of the region, :data:`RECOMPUTE_ALL` where it keeps none,
    else a :class:`Policy`. Offloaded tensors count as recomputed (offload is eager only)."""
    graph = plan.graph
    activations = set(graph.activations)
    kept = {p.storage for k, p in enumerate(graph.packs) if plan.keep[k]} & activations
    if kept == activations:
        return KEEP_ALL
    if not kept:
        return RECOMPUTE_ALL
    decisions: dict = {}
    for op in graph.ops:
        if isinstance(op.func, Opaque):  # a split-off submodule: compile runs its own checkpoint
            continue
        # Compile saves an op's outputs together: kept where the plan keeps all it makes that
        # backward holds (native_layer_norm's statistics without its output: recomputed whole).
        made = [s for s, _ in op.new_storages if s in activations]
        key = (str(op.func), _signature(op.leaves))
        decisions.setdefault(key, []).append(bool(made) and all(s in kept for s in made) and key[0] not in _NORMS)
    # Only what keeps something, up to its last kept occurrence: an op not listed is recomputed,
    # so plans that keep the same ops are the same policy (a fake trace has prim.device calls).
    kept_ops = {k: tuple(v[:max(i for i, keep in enumerate(v) if keep) + 1]) for k, v in decisions.items() if any(v)}
    if not kept_ops:
        return RECOMPUTE_ALL
    return _intern(tuple(sorted(kept_ops.items(), key=repr)))


def _key(func, budget, preserve_rng_state, cost) -> tuple:
    # type(budget): 1 (one byte) and 1.0 (everything) are equal in Python.
    return getattr(func, "__name__", None), type(budget), budget, preserve_rng_state, cost


def owner_of(fn, args) -> tuple:
    """Where a region's policy is kept: ``(module, function)`` for a method, or for a function
    whose first argument is a module (transformers' ``partial(forward, layer)``); else ``(fn, None)``.
    As gradaccel.checkpoint keys its eager plans, in a form dynamo traces."""
    if isinstance(fn, types.MethodType):
        return fn.__self__, fn.__func__
    if isinstance(fn, types.FunctionType) and args and isinstance(args[0], torch.nn.Module):
        return args[0], fn
    return fn, None


def find(owner, func, budget, preserve_rng_state, cost):
    """The policy remembered for this region and budget (read by dynamo, which guards on it),
    or None: the region has not been planned yet."""
    table = getattr(owner, _TABLE, None)
    if table is None:
        return None
    return table.get(_key(func, budget, preserve_rng_state, cost))


def remember(owner, func, budget, preserve_rng_state, cost, plan) -> None:
    """Keeps the policy of ``plan`` on ``owner`` (the region's module or function) for compiled
    calls; the first plan of a region and budget stays (a new object would fail dynamo's guards
    and recompile). Owners without attributes (builtins, tensors' methods) keep none."""
    if plan is None or isinstance(owner, torch.Tensor):
        return
    try:
        table = vars(owner).setdefault(_TABLE, {})
    except TypeError:
        return
    table.setdefault(_key(func, budget, preserve_rng_state, cost), policy_of(plan))


def block_policy(block):
    """Under compile, the policy ``memory=`` chose for ``block`` at this call's input shape
    (gradaccel/memory/target.py); else None."""
    if not torch.compiler.is_compiling():
        return None
    plan = plan_of(block)
    return None if plan is None else plan.policy


def contexts(policy: Policy):
    """``context_fn`` for ``torch.utils.checkpoint``: selective checkpointing with ``policy``."""
    return _tc.create_selective_checkpoint_contexts(policy.counter())


def run(function, args, kwargs, policy, preserve_rng_state=True):
    """``function(*args, **kwargs)`` as the region of a compiled graph under ``policy``."""
    if isinstance(policy, str) and policy == KEEP_ALL:
        return function(*args, **kwargs)
    more = {} if isinstance(policy, str) else {"context_fn": functools.partial(contexts, policy)}  # str: RECOMPUTE_ALL
    if not torch.compiler.is_compiling():
        return _tc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **more,
                              **kwargs)
    from torch._dynamo.comptime import comptime

    comptime(_side_effects_forward_only)
    out = _tc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **more, **kwargs)
    comptime(_side_effects_restored)
    return out


# Python side effects inside a region (transformers' kernels hub sets a context variable around
# attention) make dynamo refuse to trace torch.utils.checkpoint, unless told that they need not
# run again in backward. gradaccel's own replay never reruns a region's Python (it replays aten
# ops), so that is gradaccel's meaning in eager mode too: the flag is on while a region is traced.
_SIDE_EFFECTS_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
_SAVED_FLAG: list = []


def _side_effects_forward_only(ctx) -> None:
    config = torch._dynamo.config
    if hasattr(config, _SIDE_EFFECTS_FLAG):
        if not _SAVED_FLAG:
            _SAVED_FLAG.append(getattr(config, _SIDE_EFFECTS_FLAG))
        setattr(config, _SIDE_EFFECTS_FLAG, True)


def _side_effects_restored(ctx) -> None:
    if _SAVED_FLAG:
        setattr(torch._dynamo.config, _SIDE_EFFECTS_FLAG, _SAVED_FLAG.pop())


# -- planning at trace time ----------------------------------------------------------------------
def prepare(function, args, kwargs, owner, func, budget, preserve_rng_state, cost) -> None:
    """Called while dynamo traces a region: where ``owner`` has no policy for it yet, the
    region is traced and planned now, at trace time, as eagerly (gradaccel's tracer and planner),
    on fake tensors shaped as dynamo's (its size hints, where sizes are dynamic). Nothing runs
    at run time: dynamo reads the policy after this call, from ``owner``, and guards on it."""
    from torch._dynamo.comptime import comptime

    comptime(_plan_now)


def _plan_now(ctx) -> None:
    # The locals of prepare(), as dynamo sees them, made real objects again: modules and
    # functions as they are, tensors as fake ones.
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    names = ("function", "args", "kwargs", "owner", "func", "budget", "preserve_rng_state", "cost")
    try:
        local = {n: _real(ctx.get_local(n)._i_will_not_complain_if_bc_breaks_VariableTracker(), tx) for n in names}
    except _Unreadable as e:
        _warn(f"a region's arguments could not be read while compiling ({e})")
        return
    owner, func = local["owner"], local["func"]
    key = (local["budget"], local["preserve_rng_state"], local["cost"])
    if find(owner, func, *key) is not None:
        return
    try:
        plan = plan_on_fakes(local["function"], local["args"], local["kwargs"], *key, module=owner)
    except Exception as e:  # noqa: BLE001 (the region then runs eagerly, as before compile)
        _warn(f"{type(e).__name__}: {e}")
        return
    remember(owner, func, *key, plan)


class _Unreadable(Exception):
    pass


def _real(vt, tx):
    """The Python object a dynamo VariableTracker stands for: a tensor as its fake example value."""
    from torch._dynamo import variables as v

    vt = vt.realize()
    if isinstance(vt, v.TensorVariable):
        return vt.as_proxy().node.meta["example_value"]
    if isinstance(vt, v.SymNodeVariable):
        return _hint(vt.sym_num)
    if isinstance(vt, (v.TupleVariable, v.ListVariable)):
        items = [_real(x, tx) for x in vt.items]
        return tuple(items) if isinstance(vt, v.TupleVariable) else items
    if isinstance(vt, v.ConstDictVariable):
        return {_real(getattr(k, "vt", k), tx): _real(x, tx) for k, x in vt.items.items()}
    if isinstance(vt, v.NNModuleVariable):
        return tx.output.get_submodule(vt.module_key)
    if isinstance(vt, v.FunctoolsPartialVariable):
        return functools.partial(_real(vt.func, tx), *[_real(x, tx) for x in vt.args],
                                 **{k: _real(x, tx) for k, x in vt.keywords.items()})
    if isinstance(vt, v.UserMethodVariable):
        return types.MethodType(vt.fn, _real(vt.obj, tx))
    if isinstance(vt, v.UserFunctionVariable):
        return vt.fn
    if vt.is_python_constant():
        return vt.as_python_constant()
    if hasattr(vt, "value"):  # a module, an object of the user's
        return vt.value
    raise _Unreadable(type(vt).__name__)


def _hint(n) -> int:
    """A (symbolic) size as the number dynamo traced it at."""
    if isinstance(n, torch.SymInt):
        return n.node.hint if n.node.hint is not None else n.node.shape_env.size_hint(n.node.expr)
    return n


def plan_on_fakes(function, args, kwargs, budget, preserve_rng_state, cost, module=None):
    """The plan ``gradaccel.checkpoint`` makes for ``function(*args, **kwargs)`` at ``budget``,
    traced on fake tensors: ``args``' tensors (fake or real) stand in for fake ones of the same
    sizes, strides, dtypes and devices, and so do the parameters and buffers of ``module`` (the
    region's owner) while it runs.

    Raises:
        ValueError: the region reads tensor data into Python (no plan can be replayed).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            f = torch.empty_strided([_hint(n) for n in t.shape], [_hint(n) for n in t.stride()], dtype=t.dtype,
                                    device=t.device)
        return f.requires_grad_(t.requires_grad)

    args, kwargs = tree_map(fake, (args, kwargs))
    flat = tree_flatten((args, kwargs))[0]
    graph = Graph(flat, preserve_rng_state, cost if not isinstance(cost, str) or cost != "measured" else "flops")
    frame = TraceFrame(graph, flat, capture_rng({t.device for t in flat if isinstance(t, torch.Tensor)}))
    with _fake_parameters(module, mode), mode, torch.enable_grad(), saved_tensors_hooks(frame.pack, frame.unpack), \
            DataReads(graph), frame.recorder:
        out = function(*args, **kwargs)
    frame.finish(out)
    graph.take_externals()
    if graph.dynamic:
        raise ValueError(f"the region runs {graph.dynamic_reason}, which depends on tensor values")
    planner = Planner(graph)
    nbytes = budget if isinstance(budget, int) else int(budget * graph.activation_bytes)
    return planner.plan(nbytes, None, rng_state_bytes(graph) if planner.random else 0)


@contextlib.contextmanager
def _fake_parameters(module, mode):
    """``module``'s parameters and buffers as fake tensors while the trace runs (a real one would
    be made fake anew at each op, and its views would look like activations of the region)."""
    swapped, fakes = [], {}
    if isinstance(module, torch.nn.Module):
        for m in module.modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in fakes:
                        f = mode.from_tensor(t.detach())
                        is_param = isinstance(t, torch.nn.Parameter)
                        fakes[id(t)] = torch.nn.Parameter(f, t.requires_grad) if is_param else f
                    swapped.append((table, name, t))
                    table[name] = fakes[id(t)]
    try:
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


def _warn(why: str) -> None:
    warnings.warn(f"gradaccel.checkpoint: a region could not be planned while compiling ({why}); it runs "
                  "eagerly, with a graph break, and is planned there.", UserWarning, stacklevel=2)
