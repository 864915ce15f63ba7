"""``FusedAccumOptimizer``: exact gradient accumulation in one flat fp32 buffer.

The training loop stays the stock one (``loss.backward(); opt.step(); opt.zero_grad()`` every
micro-batch). A post-accumulate-grad hook on each parameter folds its gradient into that
parameter's slice of one flat fp32 buffer as soon as autograd has produced it, then frees
``param.grad`` (``gradaccel/_slots.py``); the ``step()`` that ends a window of ``accum_steps`` micro-batches makes one
finalize pass over the buffer (late scale, non-finite flag, sum of squares), optionally clips,
and runs the wrapped optimizer on fp32 gradients (or fp32 master weights).
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradaccel import ops
from gradaccel._slots import GradSlots

__all__ = ["FusedAccumOptimizer", "WindowScheduler"]

_NORMALIZE = ("mean", "items", "sum")


class FusedAccumOptimizer(torch.optim.Optimizer):
    """Wraps any optimizer so that gradients accumulate exactly in one flat fp32 buffer.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects, so LR
    schedulers, ``add_param_group`` and trainers work on the wrapper. Call ``step()`` and
    ``zero_grad()`` every micro-batch; only the ``step()`` that ends a window updates.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap (built on the model's parameters).
        accum_steps: micro-batches per window (int >= 1).
        normalize: ``"mean"``: each micro-batch loss is a mean; the window gradient is the mean
            over the micro-batches. ``"items"``: each loss is a sum over items (tokens), every
            ``step(num_items=n)`` says how many, and the window gradient is divided by the
            window's total item count (across ranks with ``process_group``). ``"sum"``: the
            losses are already scaled so that the window gradient is the plain sum of the
            micro-batch gradients (a framework's own accumulation loop, such as Hugging Face
            ``Trainer`` dividing by ``num_items_in_batch``); use it with ``accum_steps=1`` and a
            loop that calls ``step()`` once per window (see ``gradaccel.hf``).
        max_grad_norm: if set (> 0), clip the window gradient's total 2-norm to it like
            ``torch.nn.utils.clip_grad_norm_``. ``last_grad_norm`` holds the norm before
            clipping after every window, whether or not clipping is on.
        master_weights: give bf16/fp16 parameters fp32 master copies; the wrapped optimizer's
            ``param_groups`` then hold the masters (same order), and after each update every
            parameter equals its master rounded to the parameter's dtype.
        process_group: a ``torch.distributed`` group: the fp32 window buffer is all-reduced once
            per window and averaged over ranks. Use on a plain (not DDP-wrapped) model.

    Attributes:
        skipped_steps: windows skipped because their gradient was not finite.
        last_grad_norm: float, the total gradient norm of the last finished window.
        window_loss: float or None, the loss of the last finished window, weighted as its
            gradient is (mean of the micro-batch losses with ``"mean"``, summed losses over the
            window's items with ``"items"``, their sum with ``"sum"``), from the losses handed to
            ``step(loss=...)``; None when none were. With equal micro-batches it is the
            big batch's loss.

    Notes:
        At the update the inner optimizer sees fp32 ``.grad`` views into the flat buffer on fp32
        parameters and masters (a bf16/fp16 parameter without a master gets a temporary copy in
        its dtype); they are set back to None afterwards, so nothing but the buffer is held
        between windows. A parameter that got no gradient in a window keeps ``.grad`` None, as in
        stock PyTorch. Parameters with ``requires_grad=False`` at construction get no slice.
        A bf16/fp16 parameter written in place outside the optimizer (``model.load_state_dict``)
        is re-read into its master before the next update. ``add_param_group`` must be called on
        the wrapper, not the inner optimizer. The hooks go when the wrapper is collected.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accum_steps: int, *,
                 normalize: str = "mean", max_grad_norm: float | None = None,
                 master_weights: bool = False, process_group: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, FusedAccumOptimizer):
            raise TypeError("optimizer is already a FusedAccumOptimizer; wrap the inner optimizer once")
        if _needs_closure(optimizer):
            raise TypeError(f"{type(optimizer).__name__}.step() needs a closure that it calls again and "
                            "again on one batch (a line search): it cannot accumulate over micro-batches")
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}")
        if normalize not in _NORMALIZE:
            raise ValueError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")
        if max_grad_norm is not None:
            if (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                    or math.isnan(max_grad_norm) or max_grad_norm <= 0):
                raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
            max_grad_norm = float(max_grad_norm)
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialized; "
                             "call torch.distributed.init_process_group first")

        # Optimizer.__init__ is not called: it would build param_groups of its own, and the
        # contract is that the wrapper shares the inner optimizer's (see the properties below).
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

        self.accum_steps = accum_steps
        self.normalize = normalize
        self.max_grad_norm = max_grad_norm
        self.master_weights = master_weights
        # Weakly: a process group still referenced at interpreter exit is torn down there, which
        # aborts gloo processes about half the time after destroy_process_group().
        self._group = None if process_group is None else weakref.ref(process_group)
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.window_loss: float | None = None
        self._loss: torch.Tensor | None = None  # the window's summed micro-batch losses
        self._pending: tuple | None = None  # (norm, touched) of a window finalized by clip_grad_norm_
        self._warned_empty = False

        self._slots = GradSlots(master_weights)
        self._micro = 0
        self._items = 0.0
        self._items_t: torch.Tensor | None = None
        self._mean_scale: tuple[tuple[int, int], torch.Tensor] | None = None

        for group in optimizer.param_groups:
            group["params"] = self._slots.adopt(group["params"], optimizer.state)
        self._slots.grow()

    # --- the inner optimizer's objects, shared -------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat fp32 window buffer (1-D; parameter i's slice in adoption order). Read only."""
        return self._slots.flat

    @property
    def micro_step(self) -> int:
        """Micro-batches already stepped in the current window (0 .. accum_steps-1)."""
        return self._micro

    def per_window(self, scheduler: Any) -> "WindowScheduler":
        """Wraps an LR scheduler so that its ``step()`` advances once per window, not per call.

        For training loops that step the scheduler after every ``optimizer.step()``, such as Hugging
        Face ``Trainer`` with ``gradient_accumulation_steps=1`` (this optimizer does the
        accumulation): the k-th update then uses the schedule's k-th learning rate, as with the
        framework's own accumulation. Give the schedule in windows (warm-up and total steps).

        Args:
            scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` built on this optimizer (or
                on the optimizer it wraps).

        Returns:
            A :class:`WindowScheduler`: ``step()`` passes through at the end of a window only;
            everything else (``get_last_lr()``, ``state_dict()``, ...) is the scheduler's.
        """
        return WindowScheduler(scheduler, self)

    def __getstate__(self):
        # The base class would pickle only defaults/state/param_groups and unpickle into a
        # wrapper with no buffer and no hooks: fail loudly instead.
        raise TypeError("FusedAccumOptimizer holds hooks on its parameters and cannot be pickled "
                        "or deep-copied; save and load state_dict() instead")

    def __repr__(self) -> str:
        return (f"FusedAccumOptimizer(accum_steps={self.accum_steps}, normalize={self.normalize!r}, "
                f"max_grad_norm={self.max_grad_norm}, master_weights={self.master_weights})\n"
                + repr(self.optimizer))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the wrapped optimizer and gives its parameters slices.

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``.
        """
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs")
        slots = self._slots
        n_params, n_frozen = len(slots.params), len(slots.frozen)
        try:
            group["params"] = slots.adopt(list(params), self.optimizer.state)
            self.optimizer.add_param_group(group)
        except Exception:
            slots.forget_after(n_params, n_frozen)  # no hooks left behind for a refused group
            raise
        if len(slots.params) != n_params:
            slots.grow()

    # --- the training loop ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears any ``.grad`` left on the parameters; never the window being accumulated.

        Args:
            set_to_none: set grads to None (default) rather than zeroing them in place.
        """
        for p in self._slots.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, num_items: int | float | torch.Tensor | None = None,
             loss: torch.Tensor | float | None = None) -> bool:
        """Ends a micro-batch; the call that ends a window applies the update.

        Args:
            closure: optional; called (with grad enabled) to compute the loss and run backward.
            num_items: items (e.g. tokens) in this micro-batch's summed loss; required with
                ``normalize="items"``, not accepted otherwise. An int/float or a 0-d tensor (a
                tensor is accumulated on its device, without a host sync).
            loss: optional, this micro-batch's loss (as given to backward); summed without a host
                sync, it makes ``window_loss`` at the end of the window.

        Returns:
            True when this call ended a window and applied an update; False otherwise (mid-window,
            or a window skipped because its gradient was not finite).
        """
        if self.normalize == "items":
            if num_items is None:
                raise ValueError('normalize="items" needs step(num_items=n): the number of items '
                                 "(e.g. tokens) summed in this micro-batch's loss")
            if isinstance(num_items, torch.Tensor):
                n = num_items.detach().to(device=self._slots.flat.device, dtype=torch.float64)
                self._items_t = n if self._items_t is None else self._items_t + n
            elif isinstance(num_items, bool) or not isinstance(num_items, numbers.Real) or not num_items >= 0:
                raise ValueError(f"num_items must be a number >= 0 or a tensor, got {num_items!r}")
            else:
                self._items += float(num_items)
        elif num_items is not None:
            raise ValueError('num_items is only used with normalize="items"; this optimizer '
                             f"normalizes by {self.normalize!r}")
        if closure is not None:
            with torch.enable_grad():
                closure()
        if loss is not None:
            self._add_loss(loss)
        self._slots.fold_leftovers()
        self._slots.tick()
        self._micro += 1
        if self._micro < self.accum_steps:
            return False
        return self._end_window()

    def _window_scale(self, world: int) -> torch.Tensor:
        flat = self._slots.flat
        if self.normalize in ("mean", "sum"):
            steps = self.accum_steps if self.normalize == "mean" else 1
            key = (steps, world)  # accum_steps may be changed between windows
            if self._mean_scale is None or self._mean_scale[0] != key:
                # torch.full, not torch.tensor: no host-to-device copy on CUDA.
                self._mean_scale = key, torch.full((), 1.0 / (steps * world),
                                                   dtype=torch.float32, device=flat.device)
            return self._mean_scale[1]
        total = torch.full((), self._items, dtype=torch.float64, device=flat.device)
        if self._items_t is not None:
            total = total + self._items_t
        return total.reciprocal().float()

    def _add_loss(self, loss: torch.Tensor | float) -> None:
        loss = torch.as_tensor(loss).detach().to(device=self._slots.flat.device, dtype=torch.float64)
        self._loss = loss if self._loss is None else self._loss + loss

    def _finalize(self) -> tuple[float, list[bool], bool]:
        """Reduces, scales and measures the window's gradient. Returns (norm, touched, finite)."""
        flat = self._slots.flat
        touched = self._slots.touched()
        self._slots.zero_untouched(touched)
        world = 1
        if self._group is not None:
            group = self._group()
            if group is None:
                raise RuntimeError("FusedAccumOptimizer: its process_group was destroyed; "
                                   "build a new optimizer for the new group")
            world = dist.get_world_size(group)
            # Items and "who got a gradient" travel in one small fp64 all-reduce: every rank must
            # hand the same parameters to the inner optimizer, or they would drift apart.
            meta = torch.tensor([self._items] + [float(t) for t in touched], dtype=torch.float64,
                                device=flat.device)
            if self._items_t is not None:
                meta[0] += self._items_t
            dist.all_reduce(flat, group=group)
            dist.all_reduce(meta, group=group)
            host = meta.tolist()
            self._items, self._items_t = host[0], None
            touched = [t > 0 for t in host[1:]]
        scale = self._window_scale(world)
        sumsq, nonfinite = ops.finalize_(flat, scale)
        parts = [sumsq, nonfinite.double()]
        if self._loss is not None:  # weighted as the gradient is: the same scale
            parts.append(self._loss * scale.double())
        # One host sync per window, for the flag, the norm and the loss.
        host = torch.stack(parts).tolist()
        ss, nf = host[0], host[1]
        self.window_loss = host[2] if self._loss is not None else None
        norm = math.sqrt(ss) if ss >= 0 else float("nan")
        self.last_grad_norm = norm
        return norm, touched, not nf and math.isfinite(norm)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Finishes the window's gradient now and clips it, for loops that clip before ``step()``.

        For a framework's accumulation loop (``normalize="sum"``, ``accum_steps=1``): where it
        would call ``torch.nn.utils.clip_grad_norm_`` on ``.grad`` that this optimizer has freed
        (``gradaccel.hf`` routes ``accelerator.clip_grad_norm_`` here). The next ``step()``
        applies the clipped gradient, or skips the window if it is not finite.

        Args:
            max_norm: the largest total 2-norm (``float("inf")``: measure only, no clipping).

        Returns:
            0-d fp32 tensor: the total norm before clipping (NaN if not finite), as torch's.
        """
        if self.normalize == "items" or self._micro != self.accum_steps - 1:
            raise RuntimeError("FusedAccumOptimizer.clip_grad_norm_ is for the call just before the "
                               "step() that ends a window, with normalize='mean' or 'sum'; otherwise "
                               "pass max_grad_norm= to the optimizer")
        if self._pending is None:
            self._slots.fold_leftovers()
            self._pending = self._finalize()
        norm, _, finite = self._pending
        if finite and max_norm is not None:
            coef = float(max_norm) / (norm + 1e-6)  # the same epsilon as clip_grad_norm_
            if coef < 1.0:
                self._slots.flat.mul_(coef)
        return torch.tensor(norm if finite else float("nan"), dtype=torch.float32)

    def _end_window(self) -> bool:
        if self._pending is not None:  # finalized and clipped by clip_grad_norm_
            (norm, touched, finite), clip = self._pending, None
        else:
            (norm, touched, finite), clip = self._finalize(), self.max_grad_norm
        if not any(touched):
            if not self._warned_empty:
                self._warned_empty = True
                warnings.warn("FusedAccumOptimizer: a window ended with no gradient at all (no backward "
                              "reached a parameter of this optimizer since the last update); nothing "
                              "was updated. Call loss.backward() before step(), and build the optimizer "
                              "on the parameters that train", UserWarning, stacklevel=3)
            self._reset_window()
            return False
        if not finite:
            self.skipped_steps += 1
            warnings.warn(f"FusedAccumOptimizer: non-finite gradient in this window (norm={norm}; "
                          "with normalize='items' also check num_items > 0); update skipped "
                          f"({self.skipped_steps} skipped so far)", UserWarning, stacklevel=3)
            self._reset_window()
            return False
        if clip is not None:
            coef = clip / (norm + 1e-6)  # the same epsilon as clip_grad_norm_
            if coef < 1.0:
                self._slots.flat.mul_(coef)
        self._apply(touched)
        self._reset_window()
        return True

    def _apply(self, touched: list[bool]) -> None:
        slots = self._slots
        slots.sync_masters()
        for t, q, v in zip(touched, slots.targets, slots.views):
            # A parameter with no gradient in the whole window keeps grad None, as in stock
            # PyTorch, so the inner optimizer skips it (no decay, no momentum).
            if t:
                g = v if q.dtype == torch.float32 else v.to(q.dtype)
                if g.stride() != q.stride():  # re-laid out since adoption (model.to(channels_last))
                    g = torch.empty_like(q).copy_(g)  # fused kernels pair elements by memory
                q.grad = g
        self.optimizer.step()
        for q in slots.targets:
            q.grad = None  # the views alias the buffer; drop them so nothing is held between windows
        slots.write_back_masters()

    def reset_window(self) -> None:
        """Discards the window in progress: every gradient folded since the last update.

        For a micro-batch whose backward failed halfway (out of memory, say): its gradients
        are already in the buffer, mixed with the window's, and cannot be taken out alone.
        ``zero_grad()`` leaves the window alone by design; this drops it. The next micro-batch
        starts a new window.
        """
        for p in self._slots.params:
            p.grad = None
        self._slots.tick()  # what was folded so far belongs to no window
        self._reset_window()

    def _reset_window(self) -> None:
        self._micro = 0
        self._items, self._items_t = 0.0, None
        self._loss, self._pending = None, None
        self._slots.start_window()

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"gradaccel"`` entry.

        Returns:
            dict with ``"state"`` and ``"param_groups"`` (the inner optimizer's, over the masters
            where ``master_weights``) and ``"gradaccel"``: the fp32 masters, the window buffer,
            which parameters got a gradient this window, and the counters. Mid-window the
            buffer is a copy, so the dict stays a consistent snapshot after further steps;
            between windows it is None (nothing folded yet), and ``"numel"`` says its size.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # as torch.optim.Optimizer does
            pre_hook(self)
        slots = self._slots
        sd = self.optimizer.state_dict()
        items = self._items + (self._items_t.item() if self._items_t is not None else 0.0)
        touched = slots.touched()
        # Between windows the buffer holds nothing of use: not saved (a checkpoint saved at every
        # update, as Trainer's are, would carry 4 bytes per parameter for nothing).
        live = self._micro > 0 or any(touched)
        sd["gradaccel"] = {
            "accum_steps": self.accum_steps,
            "normalize": self.normalize,
            "masters": [t if t is not p else None for p, t in zip(slots.params, slots.targets)],
            "flat": slots.rowmajor(copy=True) if live else None,
            "numel": slots.flat.numel(),
            "touched": touched,
            "micro": self._micro,
            "items": items,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            sd = post_hook(self, sd) or sd
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a ``state_dict()``, including a window in progress.

        Args:
            state_dict: from ``state_dict()`` of a wrapper over the same parameters.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():  # as torch.optim.Optimizer does
            state_dict = pre_hook(self, state_dict) or state_dict
        sd = dict(state_dict)
        extra = sd.pop("gradaccel", None)
        if extra is None:
            raise ValueError("state_dict has no 'gradaccel' entry: it was not saved by "
                             "FusedAccumOptimizer.state_dict() (load the inner optimizer's own "
                             "state dict into opt.optimizer instead)")
        slots = self._slots
        numel = extra["flat"].numel() if extra["flat"] is not None else extra["numel"]
        if numel != slots.flat.numel() or len(extra["masters"]) != len(slots.params):
            raise ValueError("state_dict was saved for different parameters "
                             f"({numel} elements, this optimizer has {slots.flat.numel()})")
        if any((m is None) != (t is p) for p, t, m in zip(slots.params, slots.targets, extra["masters"])):
            raise ValueError("state_dict was saved with another master_weights setting or dtypes")
        if extra["normalize"] != self.normalize:
            raise ValueError(f"state_dict was saved with normalize={extra['normalize']!r}; this optimizer "
                             f"has normalize={self.normalize!r}")
        if extra["micro"] and extra["accum_steps"] != self.accum_steps:
            raise ValueError(f"state_dict was saved in the middle of a window of accum_steps="
                             f"{extra['accum_steps']}; this optimizer has accum_steps={self.accum_steps}. "
                             "Resume with the same accum_steps (change it between windows)")
        self.optimizer.load_state_dict(sd)
        with torch.no_grad():
            if extra["flat"] is not None:  # else saved between windows: nothing folded to restore
                slots.load_rowmajor(extra["flat"])
            for p, t, m in zip(slots.params, slots.targets, extra["masters"]):
                if m is not None:
                    t.copy_(m)
                    p.copy_(t)
            slots.note_versions()
        self._micro = int(extra["micro"])
        slots.restart(self._micro, extra["touched"])
        self._items, self._items_t = float(extra["items"]), None
        self.skipped_steps = int(extra["skipped_steps"])
        self.last_grad_norm = extra["last_grad_norm"]
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume the usual optional closure
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


class WindowScheduler:
    """An LR scheduler whose ``step()`` advances only when its FusedAccumOptimizer ended a window.

    Made by :meth:`FusedAccumOptimizer.per_window`. Attributes and methods other than ``step``
    are the wrapped scheduler's; ``scheduler`` is the wrapped one.
    """

    def __init__(self, scheduler: Any, optimizer: FusedAccumOptimizer) -> None:
        target = getattr(scheduler, "optimizer", None)
        if target is not optimizer and target is not optimizer.optimizer:
            raise ValueError("per_window: the scheduler must be built on this FusedAccumOptimizer "
                             "(or on the optimizer it wraps)")
        self.scheduler = scheduler
        self.fused = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        # micro_step is 0 right after the step() that ended a window (applied or skipped), and
        # before the first one: a call made before any optimizer step advances, as torch's does.
        if self.fused.micro_step == 0:
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)
