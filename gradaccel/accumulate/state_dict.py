"""Save and load for ``FusedAccumOptimizer``: the inner optimizer's state dict plus the window.

The ``"gradaccel"`` entry holds what resuming mid-window needs: the window buffer (row-major per
parameter, so that it loads into a model of another memory layout), the fp32 masters, which
parameters got a gradient this window, and the counters. Between windows the buffer holds
nothing of use and is not saved (a checkpoint saved at every update, as Trainer's are, would
carry 4 bytes per parameter for nothing); ``"numel"`` says its size.

On a ``fully_shard`` model the entry is laid out for ``torch.distributed.checkpoint`` (DCP), which
saves a plain tensor once, as replicated, and loads in place into a template state dict. So the
per-rank window buffer travels as one DTensor per parameter (sharded like it), the item count as
a DTensor of per-rank counts, and the inner optimizer's state has an entry for every parameter
even before its first update.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccel.accumulate.sharded import DTensor, Shard, as_grad, local
from gradaccel.accumulate.slots import GradSlots


def save(optimizer: torch.optim.Optimizer, slots: GradSlots, sync: Any, *, accum_steps: int,
         normalize: str, micro: int, items: float, skipped_steps: int,
         last_grad_norm: float | None) -> dict[str, Any]:
    """The wrapper's state dict (see ``FusedAccumOptimizer.state_dict``).

    Args:
        optimizer: the inner optimizer.
        slots: the wrapper's parameters and window buffer.
        sync: its ``ReplicatedSync`` or ``ShardedWindow``.
        accum_steps, normalize, micro, items, skipped_steps, last_grad_norm: the wrapper's
            settings and counters (``items``: this rank's count so far in the window).

    Returns:
        The inner optimizer's state dict with a ``"gradaccel"`` entry.

    Raises:
        ValueError: mid-window with ``sync="window"``, whose gradients are FSDP2's.
    """
    unset = None
    touched = slots.touched()
    if not sync.sharded:
        sd = optimizer.state_dict()
        flat = slots.rowmajor(copy=True) if micro > 0 or any(touched) else None
    else:
        if micro and sync.sync == "window":
            raise ValueError("sync='window': mid-window the gradients are FSDP2's unsharded ones, "
                             "which a state dict cannot hold; save at the end of a window (after "
                             "the step() that returned True) or use sync='micro_batch'")
        sync.hold(slots.flat, True)  # sync="window" releases it between windows
        sd, unset = inner_state_dict(optimizer, slots.targets)
        # A copy mid-window, and with sync="window", whose buffer is released between windows.
        flat = window_dtensors(slots.rowmajor(copy=False), slots.offsets, slots.params,
                               copy=micro > 0 or sync.sync == "window")
        items = items_dtensor(items, slots.params[0])  # each rank's own count so far
    sd["gradaccel"] = {
        "accum_steps": accum_steps,
        "normalize": normalize,
        "masters": slots.masters(),
        "flat": flat,
        "numel": slots.flat.numel(),
        "touched": touched,
        "micro": micro,
        "items": items,
        "skipped_steps": skipped_steps,
        "last_grad_norm": last_grad_norm,
    }
    if sync.sharded:  # inner entries made up for DCP; dropped at load
        sd["gradaccel"]["unset"] = unset
    return sd


def load(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, slots: GradSlots, sync: Any, *,
         accum_steps: int, normalize: str) -> dict[str, Any]:
    """Checks ``state_dict`` against the wrapper, then restores the inner optimizer, the window
    buffer, the masters and which parameters got a gradient.

    Args:
        state_dict: from ``save``.
        optimizer, slots, sync: as for :func:`save`.
        accum_steps, normalize: the wrapper's settings, which a mid-window state must match.

    Returns:
        The counters to restore: ``micro``, ``items`` (float, this rank's or the sum of the
        saved per-rank counts), ``skipped_steps`` and ``last_grad_norm``.

    Raises:
        ValueError: no ``"gradaccel"`` entry, or one saved for other parameters or settings.
    """
    sd = dict(state_dict)
    extra = sd.pop("gradaccel", None)
    if extra is None:
        raise ValueError("state_dict has no 'gradaccel' entry: it was not saved by "
                         "FusedAccumOptimizer.state_dict() (load the inner optimizer's own "
                         "state dict into opt.optimizer instead)")
    flat = extra["flat"]
    if sync.sharded:
        flat = window_flat(flat, slots.params)
        sync.hold(slots.flat, True)
    numel = flat.numel() if flat is not None else extra["numel"]
    if numel != slots.flat.numel() or len(extra["masters"]) != len(slots.params):
        raise ValueError("state_dict was saved for different parameters "
                         f"({numel} elements, this optimizer has {slots.flat.numel()})")
    if any((m is None) != (have is None) for have, m in zip(slots.masters(), extra["masters"])):
        raise ValueError("state_dict was saved with another master_weights setting or dtypes")
    if extra["normalize"] != normalize:
        raise ValueError(f"state_dict was saved with normalize={extra['normalize']!r}; this optimizer "
                         f"has normalize={normalize!r}")
    if extra["micro"] and extra["accum_steps"] != accum_steps:
        raise ValueError(f"state_dict was saved in the middle of a window of accum_steps="
                         f"{extra['accum_steps']}; this optimizer has accum_steps={accum_steps}. "
                         "Resume with the same accum_steps (change it between windows)")
    optimizer.load_state_dict(sd)
    inner = [q for group in optimizer.param_groups for q in group["params"]]
    unset = extra.get("unset")
    for q, drop in zip(inner, unset.tolist() if unset is not None else ()):
        if drop:
            optimizer.state.pop(q, None)
    with torch.no_grad():
        if flat is not None:  # else saved between windows: nothing folded to restore
            slots.load_rowmajor(flat)
        slots.load_masters(extra["masters"])
    micro = int(extra["micro"])
    slots.restart(micro, extra["touched"])
    items = extra["items"]
    # A DTensor of per-rank counts (fully_shard): only their sum matters at the window's end.
    items = float(local(items).sum()) if torch.is_tensor(items) else float(items)
    return {"micro": micro, "items": items, "skipped_steps": int(extra["skipped_steps"]),
            "last_grad_norm": extra["last_grad_norm"]}



def inner_state_dict(optimizer: torch.optim.Optimizer,
                     targets: list[torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """``optimizer.state_dict()`` with an entry for every one of ``targets`` (the trainable
    parameters, or their fp32 masters, which do not require grad); and a bool tensor,
    one per parameter, marking the entries made up for that (the optimizer had no state for them).
    A tensor of fixed length, not a list of indices: DCP loads into a template by key.

    The made-up entries come from a step with zero gradients at lr 0 (what
    ``torch.distributed.checkpoint.state_dict`` does for a fresh optimizer), taken out of
    ``optimizer.state`` again, so this has no effect on training; load drops them.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    trainable = {id(t) for t in targets}
    unset = [i for i, p in enumerate(params) if id(p) in trainable and p not in optimizer.state]
    mask = torch.zeros(len(params), dtype=torch.bool)
    mask[unset] = True
    if not unset:
        return optimizer.state_dict(), mask
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for i, p in enumerate(params):
            p.grad = torch.zeros_like(p) if i in unset else None
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
        optimizer.step()
        sd = optimizer.state_dict()
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for i in unset:
            optimizer.state.pop(params[i], None)
    return sd, mask


def items_dtensor(items: float, like: torch.Tensor) -> torch.Tensor:
    """This rank's item count so far in the window, as its element of a DTensor over ``like``'s
    mesh: DCP would save a plain value once, from one rank, and each rank counts its own."""
    return DTensor.from_local(torch.tensor([items], dtype=torch.float64), like.device_mesh, [Shard(0)],
                              run_check=False)


def window_dtensors(flat: torch.Tensor, offsets: list[int], params: list[torch.Tensor], copy: bool) -> list:
    """The row-major window buffer ``flat`` as one fp32 DTensor per parameter, sharded like it."""
    out = []
    for o, p in zip(offsets, params):
        shard = flat[o: o + local(p).numel()].view(local(p).shape)
        out.append(as_grad(shard.clone() if copy else shard, p))
    return out


def window_flat(window: list, params: list[torch.Tensor]) -> torch.Tensor:
    """:func:`window_dtensors` back to this rank's row-major flat buffer."""
    if not isinstance(window, (list, tuple)) or len(window) != len(params):
        raise ValueError("state_dict was saved for different parameters (or without fully_shard)")
    for w, p in zip(window, params):
        if local(w).shape != local(p).shape:
            raise ValueError(f"state_dict holds a window shard of shape {tuple(local(w).shape)} for a "
                             f"parameter whose shard here is {tuple(local(p).shape)}; load it through "
                             "torch.distributed.checkpoint, which reshards DTensors")
    return torch.cat([local(w).reshape(-1).float() for w in window]) if window else torch.zeros(0)
