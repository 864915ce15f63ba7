"""What a fit was made for, and ``Fit.apply``'s check of the model and optimizer it is given.

A plan's predicted peak holds for the model it was made for: a plan made with ``lora=8`` and
applied to the full model (every weight training: a window buffer and optimizer state for all of
them) would run far over its target without a word. So a plan records what it assumed
(:func:`facts`: trainable parameters, 4-bit weights, LoRA rank, the weights' dtype, the number of
blocks) and ``apply`` compares them with the model and optimizer it gets (:func:`check`): every
difference in one ``ValueError``, as is a plan that does not fit. ``apply(..., force=True)`` goes
on with a warning instead. A training call with a larger micro-batch than the plan's raises at
its first forward (:class:`MicroBatchGuard`); a smaller one (a last, partial batch) is smaller.
"""

import warnings

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from gradaccel.memory.counter import format_bytes

__all__ = ["facts", "model_facts", "check", "MicroBatchGuard"]


def _lora_rank(model: nn.Module):
    """The LoRA rank of ``model``'s adapters (peft's layers, or the fit's own ``LoRALinear``), or None."""
    for m in model.modules():
        a = getattr(m, "lora_A", None)
        if isinstance(a, nn.ModuleDict) and len(a):
            a = next(iter(a.values()))
        if isinstance(a, nn.Linear):
            return a.out_features
    return None


def _is_4bit(p) -> bool:
    return getattr(p, "quant_state", None) is not None or type(p).__name__ == "Params4bit"


def _weights_dtype(model: nn.Module):
    """The dtype of most of ``model``'s floating-point weight bytes, adapters and 4-bit weights aside."""
    by = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and "lora_" not in name and not _is_4bit(p):
            by[p.dtype] = by.get(p.dtype, 0) + p.numel() * p.element_size()
    return max(by, key=by.get) if by else None


def model_facts(model: nn.Module, blocks: int) -> dict:
    """What :func:`facts` records, read off ``model`` (``blocks``: how many it has)."""
    trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    return {"trainable parameters": sum(trainable.values()),
            "4-bit weights": any(_is_4bit(p) for p in model.parameters()),
            "LoRA rank": _lora_rank(model), "weights' dtype": _weights_dtype(model), "blocks": blocks}


def facts(planner) -> dict:
    """What a :class:`gradaccel.memory.fit.Planner`'s plans assume of the model they are applied to."""
    made = model_facts(planner.model, planner.blocks)
    made["trainable parameters"] = planner.static.trainable
    made["4-bit weights"] = bool(planner.load_in_4bit) or made["4-bit weights"]
    made["LoRA rank"] = planner.lora or made["LoRA rank"]
    return made


def _optimizer_params(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum({id(p): p.numel() for g in inner.param_groups for p in g["params"]}.values())


def _name(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("torch.", "")


def check(fit, model: nn.Module, optimizer, blocks: int, force: bool = False) -> None:
    """Raises one ValueError naming every way ``model`` and ``optimizer`` differ from what ``fit``
    was made for (``fit.made_for``), or that ``fit`` does not fit its target; with ``force``,
    warns instead."""
    problems = []
    if not fit.fits:
        short = fit.peak + fit.slack - (fit.memory or 0)
        problems.append(f"this plan does not fit: predicted peak {format_bytes(fit.peak)} + slack "
                        f"{format_bytes(fit.slack)} is over the target {format_bytes(fit.memory or 0)} "
                        f"(short by {format_bytes(short)})")
    made = getattr(fit, "made_for", None) or {}
    if made:
        have = model_facts(model, blocks)
        differ = [f"{k}: the plan's {_name(v)}, the model's {_name(have[k])}" for k, v in made.items()
                  if k in have and have[k] != v]
        held = _optimizer_params(optimizer)
        if held != made["trainable parameters"]:
            differ.append(f"the optimizer holds {held:,} parameters, the plan {made['trainable parameters']:,}")
        accum = getattr(optimizer, "accum_steps", None)
        if accum is not None and accum != fit.accum_steps:
            differ.append(f"accumulation steps: the plan's {fit.accum_steps}, the optimizer's {accum}")
        if differ:
            problems.append("the plan was made for another model or optimizer (" + "; ".join(differ) + ")")
    elif len(fit.budgets) != blocks:
        problems.append(f"model has {blocks} blocks, the fit was made for {len(fit.budgets)}")
    if not problems:
        return
    text = "gradaccel.fit: " + "; ".join(problems)
    if force:
        warnings.warn(text + "; applied anyway (force=True): its predicted peak does not hold", UserWarning,
                      stacklevel=3)
        return
    raise ValueError(text + ". Plan again for this model and optimizer, or apply(..., force=True) to use it anyway")


class MicroBatchGuard:
    """A forward pre-hook: a training call of more sequences than the plan's micro-batch raises
    (its peak is not the predicted one), or with ``force``, warns once."""

    def __init__(self, micro_batch: int, force: bool = False):
        self.micro_batch, self.force, self.warned = micro_batch, force, False

    def __call__(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()), None)
        if first is None or first.shape[0] <= self.micro_batch:
            return None
        text = (f"gradaccel.fit: a training call of micro-batch {first.shape[0]}, the plan's is {self.micro_batch}: "
                "its peak is over the predicted one")
        if not self.force:
            raise ValueError(text + "; feed micro-batches of the plan's size (or plan for this one)")
        if not self.warned:
            self.warned = True
            warnings.warn(text + " (force=True)", UserWarning, stacklevel=2)
        return None
