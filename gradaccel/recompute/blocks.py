"""Checkpoint every repeated block of a model in place: the mechanism under ``checkpoint_blocks``.

Two routes. Hugging Face ``PreTrainedModel``s that support gradient checkpointing keep their own
machinery (``GradientCheckpointingLayer`` drops the KV cache in training, skips checkpointing in
eval and under ``no_grad``, and wraps ``forward`` rather than ``__call__``); we only hand it
``gradaccel.checkpoint`` with the budget bound. Every other model gets its blocks' class swapped
for a subclass whose ``forward`` runs inside ``gradaccel.checkpoint``: the parameters, buffers and
``state_dict`` keys stay as they are, and module hooks (forward pre-hooks, forward hooks, FSDP's)
run in ``__call__`` around ``forward``, so outside the checkpointed region and once per step.
"""

import dataclasses
import functools
import inspect
import sys
import types
import warnings

import torch
import torch.nn as nn

# The budget rule is gradaccel.checkpoint's own, checked here too so that a bad value fails at
# set-up rather than in the middle of the first training step.
from gradaccel.ops import extension
from gradaccel.recompute import compiled
from gradaccel.recompute.block_plan import DEVICE, HOST, BlockPlan, Mode, plan_of, set_plan
from gradaccel.recompute.checkpoint import _check_budget, _checkpoint, check_cost
from gradaccel.recompute.host_inputs import run_parked
from gradaccel.recompute.own_forward import own_forward
from gradaccel.recompute.report import remember_model

__all__ = ["install", "set_budget", "release"]

# One checkpointed subclass per original block class, so N blocks of one class share one type.
_SUBCLASSES = {}


def _checkpointed_forward(self, *args, **kwargs):
    forward = own_forward(self, type(self)._gradaccel_subclass.__mro__[1])  # super(subclass, self).forward
    # Eval, no_grad and inference need no backward, so nothing to recompute: run as is (this also
    # keeps a KV cache that a recompute would otherwise update twice).
    plan = plan_of(self)
    if not (self.training and torch.is_grad_enabled()) or not plan.checkpointed:
        # (memory= may run the block uncheckpointed, or as its parts: gradaccel/memory/target.py)
        return forward(*args, **kwargs)
    policy = compiled.block_policy(self)  # memory= under torch.compile
    if policy is not None:
        return compiled.run(functools.partial(forward, **kwargs), args, {}, policy)
    # Keyword arguments go in through partial so that names such as `use_reentrant` or `budget`
    # reach the block, not checkpoint.
    run = functools.partial(_checkpoint_args, functools.partial(forward, **kwargs), budget=plan.budget,
                            cost=plan.cost, offload=plan.offload)
    if plan.parked:
        return run_parked(run, args)
    return run(*args)


def _checkpoint_args(function, *args, budget, cost, offload, kwargs=None, preserve_rng_state=True):
    # The checkpointed call with its tensors as positional arguments, for run_parked to swap the first.
    return _checkpoint(function, args, kwargs or {}, budget, preserve_rng_state, cost=cost, offload=offload)


def _reduce_ex(self, protocol):
    # The subclass is made at run time, so pickle cannot find it by name: pickle the block as
    # its original class and make it checkpointed again on load (torch.save(model) works).
    sub = type(self)._gradaccel_subclass
    if type(self) is not sub:  # a further subclass (e.g. FSDP's): pickle as usual
        return object.__reduce_ex__(self, protocol)
    return _restore, (sub.__mro__[1],), self.__getstate__()


def _restore(cls):
    obj = cls.__new__(cls)
    obj.__class__ = _subclass_for(cls)
    return obj


def model_class(module: nn.Module) -> type:
    """``module``'s own class: the model's, under ``checkpoint_blocks``' subclass where it has one."""
    cls = type(module)
    return cls.__mro__[1] if getattr(cls, "_gradaccel_subclass", None) is cls else cls


def _subclass_for(cls):
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Checkpointed{cls.__name__}", (cls,),
                   {"forward": _checkpointed_forward, "__reduce_ex__": _reduce_ex, "__module__": cls.__module__})
        sub._gradaccel_subclass = sub
        _SUBCLASSES[cls] = sub
    return sub


def _is_hf_checkpointable(module):
    # A PreTrainedModel exists only if transformers' modeling_utils is loaded: never import it
    # (seconds) for a plain model.
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None or not isinstance(module, modeling_utils.PreTrainedModel):
        return False
    if not getattr(module, "supports_gradient_checkpointing", False):
        return False
    # Remote code from before transformers 4.35 overrides the hook with a signature that cannot
    # take a checkpoint function: such models are handled as plain models.
    return "gradient_checkpointing_func" in inspect.signature(module._set_gradient_checkpointing).parameters


def _already_checkpointed(model, hf_models=()):
    """Why ``model`` cannot be checkpointed again, or None. Hugging Face checkpointing with
    another function inside one of ``hf_models`` is no reason: that function is taken over."""
    inside_hf = {id(m) for hf in hf_models for m in hf.modules()}
    for name, m in model.named_modules():
        if getattr(type(m), "_gradaccel_subclass", None) is not None:
            return f"{name or 'model'} is already checkpointed by gradaccel.checkpoint_blocks"
        if getattr(m, "gradient_checkpointing", False) is True:
            func = getattr(m, "_gradient_checkpointing_func", None)
            if isinstance(func, _HFCheckpoint):
                return (f"gradaccel is already on for {name or 'model'} (checkpoint_blocks, budget="
                        f"{func.budget!r}); set another budget with gradaccel.recompute.blocks.set_budget(model, budget)")
            if id(m) not in inside_hf:
                return (f"{name or 'model'} already has Hugging Face gradient checkpointing on; call "
                        "model.activation_checkpointing_disable() (gradient_checkpointing_disable() before "
                        "transformers 5) first")
        if type(m).__name__ == "CheckpointWrapper":
            return f"{name or 'model'} is already wrapped by torch's checkpoint_wrapper"
    return None


class _HFCheckpoint:
    """The ``gradient_checkpointing_func`` handed to transformers: gradaccel.checkpoint at ``budget``."""

    def __init__(self, budget, cost="flops", offload=False, inputs_on_host=False):
        self.budget, self.cost, self.offload, self.inputs_on_host = budget, cost, offload, inputs_on_host

    def __call__(self, function, *args, **kwargs):
        layer = None
        # GradientCheckpointingLayer passes partial(forward, layer, **kw), the class's function
        # with the layer as an argument. Bound as the layer's method instead, the plan is cached
        # on the layer (dropped with it) rather than on the class function with the layer held
        # in the cache key for as long as the process lives.
        if (isinstance(function, functools.partial) and inspect.isfunction(function.func)
                and function.args and isinstance(function.args[0], nn.Module)):
            layer = function.args[0]
            if not torch.compiler.is_compiling():  # (compiled: gradaccel/recompute/compiled.py's owner_of)
                method = types.MethodType(function.func, layer)
                function = functools.partial(method, *function.args[1:], **function.keywords)
        kwargs.pop("use_reentrant", None)  # gradaccel is always non-reentrant
        preserve_rng_state = kwargs.pop("preserve_rng_state", True)
        plan = plan_of(layer)  # memory= or a fit gives each layer its own plan (budget in bytes)
        if plan is not None and not plan.checkpointed:
            return function(*args, **kwargs)  # memory= runs it uncheckpointed or as its parts (gradaccel/memory/target.py)
        policy = compiled.block_policy(layer)  # memory= under torch.compile
        if policy is not None:
            return compiled.run(function, args, kwargs, policy, preserve_rng_state)
        run = functools.partial(_checkpoint_args, function, budget=self.budget if plan is None else plan.budget,
                                cost=self.cost, offload=self.offload or plan is not None and plan.offload, kwargs=kwargs,
                                preserve_rng_state=preserve_rng_state)
        parked = None if plan is None else plan.parked
        if self.inputs_on_host if parked is None else parked:
            return run_parked(run, args)
        return run(*args)

    def __repr__(self):
        return f"gradaccel.checkpoint(budget={self.budget!r}" + (", inputs_on_host=True)" if self.inputs_on_host else ")")


def _is_torch_checkpoint(func):
    # What transformers builds when told nothing special: partial(torch checkpoint, use_reentrant=...).
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    while isinstance(func, functools.partial):
        if set(func.keywords) - {"use_reentrant", "preserve_rng_state", "determinism_check", "debug"}:
            return False
        func = func.func
    return func is torch_checkpoint


_WARNED_REPLACED = set()


def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
    """Installed on a Hugging Face model by checkpoint_blocks: whoever turns HF checkpointing on
    later (Trainer, TRL, peft, the user) gets gradaccel's checkpoint at the model's budget."""
    ours = self._gradaccel_checkpoint
    func = gradient_checkpointing_func
    if enable and func is not None and func is not ours and not _is_torch_checkpoint(func):
        key = repr(func)
        if key not in _WARNED_REPLACED:  # once per kind of function
            _WARNED_REPLACED.add(key)
            warnings.warn(f"gradaccel: {type(self).__name__}'s checkpointing was asked for with {func!r}; gradaccel's "
                          f"checkpoint {ours!r} is used instead (its own keyword arguments, such as offload, are not). "
                          "Use gradaccel.checkpoint(..., offload=True) through checkpoint_blocks for offloading, "
                          "or activation_checkpointing_disable() and gradaccel.recompute.blocks.release(model) for HF's own",
                          UserWarning, stacklevel=3)
    type(self)._set_gradient_checkpointing(self, enable=enable, gradient_checkpointing_func=ours,
                                           every_n_layers=every_n_layers)


def _take_over(model, budget, cost="flops", offload=False, inputs_on_host=False):
    """Makes ``model``'s HF checkpointing gradaccel's, now (keeping which layers are on, e.g.
    ``every_n_layers``) and whenever it is turned on again. Returns whether it was on."""
    func = _HFCheckpoint(budget, cost, offload, inputs_on_host)
    model._gradaccel_checkpoint = func
    if "_set_gradient_checkpointing" not in vars(model):  # ours once; another instance override is left alone
        model._set_gradient_checkpointing = types.MethodType(_set_gradient_checkpointing, model)
    was_on = False
    for m in model.modules():
        if hasattr(m, "gradient_checkpointing"):
            m._gradient_checkpointing_func = func
            was_on = was_on or m.gradient_checkpointing is True
    return was_on


def _is_ours(hook):
    return getattr(hook, "__func__", None) is _set_gradient_checkpointing


def release(model):
    """Undoes the take-over of Hugging Face checkpointing by ``checkpoint_blocks``/``gradaccel.hf``:
    HF checkpointing is turned off and ``model._set_gradient_checkpointing`` is HF's again.

    Args:
        model (nn.Module): a model passed to ``checkpoint_blocks`` (or holding such models).
    """
    for m in model.modules():
        if "_gradaccel_checkpoint" in vars(m):
            m._set_gradient_checkpointing(enable=False)
            del m._gradaccel_checkpoint
            if _is_ours(vars(m).get("_set_gradient_checkpointing")):
                del m._set_gradient_checkpointing


def set_budget(model, budget):
    """Changes the budget of a model checkpointed by ``checkpoint_blocks`` (either route).

    Args:
        model (nn.Module): the model.
        budget (None | float | int): as in ``checkpoint_blocks``.

    Returns:
        int: how many checkpointed blocks or models got the new budget (0: none found).
    """
    _check_budget(budget)
    n = 0
    for m in model.modules():
        if "_gradaccel_checkpoint" in vars(m):
            f = m._gradaccel_checkpoint
            _take_over(m, budget, f.cost, f.offload, f.inputs_on_host)
            n += 1
        else:
            plan = plan_of(m)
            if plan is not None and plan.checkpointed:  # an HF layer's share from memory=, or a block's budget
                set_plan(m, dataclasses.replace(plan, budget=budget))
            n += getattr(type(m), "_gradaccel_subclass", None) is not None
    return n


def _hf_enable(model, budget, cost="flops", offload=False, inputs_on_host=False):
    _take_over(model, budget, cost, offload, inputs_on_host)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=model._gradaccel_checkpoint)
    # As transformers does: checkpointed blocks fed by frozen embeddings (adapters, PEFT) must
    # still see inputs that require grad, or nothing upstream of the first block gets a gradient.
    if getattr(model, "main_input_name", None) == "input_ids" or getattr(model, "_hf_peft_config_loaded", False):
        model.enable_input_require_grads()


def _hf_models(model):
    """The outermost Hugging Face models in ``model`` that checkpoint through their own hook."""
    if _is_hf_checkpointable(model):
        return [model]
    hf, inside = [], set()
    for name, m in model.named_modules():
        if name and not any(name.startswith(p + ".") for p in inside) and _is_hf_checkpointable(m):
            hf.append(m)
            inside.add(name)
    return hf


def _resolve_types(block_types):
    if isinstance(block_types, (type, str)):
        block_types = (block_types,)
    try:
        block_types = tuple(block_types)
    except TypeError:
        raise TypeError(f"block_types must be a class, a class name or a sequence of them, got {block_types!r}") from None
    for t in block_types:
        if not (isinstance(t, str) or (isinstance(t, type) and issubclass(t, nn.Module))):
            raise TypeError(f"block_types must hold nn.Module subclasses or class names, got {t!r}")
    if not block_types:
        raise ValueError("block_types is empty")
    return block_types


def _matches(module, block_types):
    return any(type(module).__name__ == t if isinstance(t, str) else isinstance(module, t) for t in block_types)


def _find_by_type(model, block_types):
    found, inside = [], set()
    for name, m in model.named_modules():
        # Outermost matches only: a block nested inside another block is already recomputed.
        if any(name.startswith(p + ".") for p in inside):
            continue
        if _matches(m, block_types):
            found.append(m)
            inside.add(name)
    return found


def _find_checkpointed(model):
    """The blocks :func:`install` swapped into its checkpointed subclass, in order."""
    return [m for m in model.modules() if getattr(type(m), "_gradaccel_subclass", None) is not None]


def _find_blocks(model):
    """The blocks: the entries of every ``nn.ModuleList`` of one class, for the class whose
    lists hold the most parameters (then the most entries). Every list of that class counts, so
    a model in stages (a list of stages, each a list of blocks) has all its blocks found."""
    lists, totals = [], {}
    for m in model.modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        kinds = {type(c) for c in m}
        if len(kinds) != 1:
            continue
        kind = kinds.pop()
        if issubclass(kind, (nn.ModuleList, nn.ModuleDict)):
            continue  # containers are never called: the blocks are inside them
        lists.append((m, kind))
        params, n = totals.get(kind, (0, 0))
        totals[kind] = (params + sum(p.numel() for p in m.parameters()), n + len(m))
    if not lists:
        return []
    kind = max(totals, key=totals.get)  # ties keep the first, i.e. the outermost
    seen, blocks = set(), []
    for m, k in lists:
        for c in (m if k is kind else ()):
            if id(c) not in seen:
                seen.add(id(c))
                blocks.append(c)
    return blocks


def find_blocks(model: nn.Module) -> list:
    """The blocks ``checkpoint_blocks`` checkpoints, or would, in forward order (as registered).

    A Hugging Face model's layers (``GradientCheckpointingLayer``); else those :func:`install`
    has checkpointed already (the ``block_types`` it was given, say); else the entries of the
    ``nn.ModuleList`` of one class that holds the most parameters.

    Args:
        model: the model.

    Returns:
        list: the blocks (empty where none is found).
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None
    found = _find_by_type(model, [GradientCheckpointingLayer]) if GradientCheckpointingLayer is not None else []
    return found or _find_checkpointed(model) or _find_blocks(model)


def install(model, budget=None, block_types=None, cost="flops", offload=False, inputs_on_host=False):
    """Checkpoints each repeated block of ``model`` in place at ``budget``: the mechanism of
    :func:`gradaccel.checkpoint_blocks` (which documents the arguments), without its ``memory=``
    target. Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_budget(budget)
    check_cost(cost)
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {offload!r}")
    if not isinstance(inputs_on_host, bool):
        raise TypeError(f"inputs_on_host must be a bool, got {inputs_on_host!r}")
    if block_types is not None:
        block_types = _resolve_types(block_types)
    hf = _hf_models(model) if block_types is None or _is_hf_checkpointable(model) else []
    reason = _already_checkpointed(model, hf)
    if reason is not None:
        raise RuntimeError(f"checkpoint_blocks: {reason}; calling it again would recompute blocks twice")
    extension.load()  # built here, on its first use, never inside a training step or a Dynamo trace
    remember_model(model)  # plan_report names its blocks by their position in it

    if hf:
        if block_types is not None:
            raise ValueError(
                f"block_types must be None for {type(model).__name__}: Hugging Face models are checkpointed "
                "through their own hook, which picks the layers")
        for m in hf:
            # Already on (peft's prepare_model_for_kbit_training, Trainer, TRL): take over HF's
            # function in place, keeping which layers are on; else turn it on with ours.
            if not _take_over(m, budget, cost, offload, inputs_on_host):
                _hf_enable(m, budget, cost, offload, inputs_on_host)
            elif getattr(m, "main_input_name", None) == "input_ids" or getattr(m, "_hf_peft_config_loaded", False):
                if not getattr(m, "_require_grads_hooks", None) and not getattr(m, "_require_grads_hook", None):
                    m.enable_input_require_grads()
        return model

    if block_types is None:
        blocks = _find_blocks(model)
        if not blocks:
            raise ValueError(
                f"checkpoint_blocks found no repeated blocks in {type(model).__name__} (no nn.ModuleList of "
                "same-class modules); pass block_types=<your block class>")
    else:
        blocks = _find_by_type(model, block_types)
        if not blocks:
            names = ", ".join(t if isinstance(t, str) else t.__name__ for t in block_types)
            raise ValueError(f"checkpoint_blocks: no module of block_types ({names}) in {type(model).__name__}")

    # A module listed twice (shared weights) is still one block: swap its class once.
    for block in {id(b): b for b in blocks}.values():
        block.__class__ = _subclass_for(type(block))
        set_plan(block, BlockPlan(Mode.BUDGET, budget=budget, offload=offload, cost=cost,
                                   parking=HOST if inputs_on_host else DEVICE))
    return model
