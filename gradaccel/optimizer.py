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
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradaccel import _sharded, ops
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
            window's total item count (across ranks with ``process_group`` or FSDP2). ``"sum"``: the
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
        sync: for an FSDP2 (``fully_shard``) model, whose parameters are DTensors: when FSDP2
            reduce-scatters. ``"micro_batch"`` (default): after every backward, folding the
            shard at once (least memory). ``"window"``: FSDP2 holds fp32 unsharded gradients for
            the window and reduce-scatters once, in the backward of the window's last
            micro-batch, which every rank must run (least communication); needs ``module``.
            The buffer holds this rank's shards only. Build the optimizer on every rank: it
            makes a small gloo group for the end-of-window check. See ``gradaccel/_sharded.py``.
        module: the ``fully_shard``-ed root module (needed for ``sync="window"``).

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
                 master_weights: bool = False, process_group: Any = None,
                 sync: str = "micro_batch", module: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, FusedAccumOptimizer):
            raise TypeError("optimizer is already a FusedAccumOptimizer; wrap the inner optimizer once")
        if _needs_closure(optimizer):
            raise TypeError(f"{type(optimizer).__name__}.step() needs a closure that it calls again and "
                            "again on one batch (a line search): it cannot accumulate over micro-batches")
        _check_accum_steps(accum_steps)
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

        self.optimizer = optimizer
        self.__dict__.update(_optimizer_internals())
        self._patch_step_function()  # profiles and hooks this class's step(), as Optimizer.__init__ does

        self._sharded = None  # the distributed half of a window over DTensor (fully_shard) params
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

        params = [p for group in optimizer.param_groups for p in group["params"]]
        if _sharded.check_params(params, process_group):
            self._sharded = _sharded.ShardedWindow([p for p in params if p.requires_grad], sync, module)
        elif sync != "micro_batch" or module is not None:
            raise ValueError("sync= and module= are for fully_shard (FSDP2) models; these parameters "
                             "are plain tensors (for data parallelism use process_group=)")
        for group in optimizer.param_groups:
            group["params"] = self._slots.adopt(group["params"], optimizer.state)
        self._slots.grow()
        if self._sharded is not None:
            self._sharded.before_micro_batch(0, accum_steps, self._slots.flat)

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
    def accum_steps(self) -> int:
        """Micro-batches per window; may be changed between windows."""
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        _check_accum_steps(value)
        self._accum_steps = value
        if self._sharded is not None:  # sync="window": which backward reduce-scatters moves with it
            self._sharded.before_micro_batch(self._micro, value, self._slots.flat)

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat fp32 window buffer (1-D; parameter i's slice in adoption order). Read only.
        With ``sync="window"`` its memory is released until the window's last micro-batch."""
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
        params = list(params)
        group_pg = self._group() if self._group is not None else None
        # The constructor's rule for the whole set: all DTensors on one mesh, or all plain.
        if _sharded.check_params(slots.params + params, group_pg) != (self._sharded is not None):
            raise ValueError("add_param_group: these parameters are DTensors (fully_shard) and the "
                             "optimizer's are plain tensors, or the other way round; build one "
                             "optimizer per kind")
        if self._sharded is not None:
            self._sharded.cover([p for p in params if p.requires_grad])
        n_params, n_frozen = len(slots.params), len(slots.frozen)
        try:
            group["params"] = slots.adopt(list(params), self.optimizer.state)
            self.optimizer.add_param_group(group)
        except Exception:
            slots.forget_after(n_params, n_frozen)  # no hooks left behind for a refused group
            raise
        if len(slots.params) != n_params:
            slots.grow()
            if self._sharded is not None:  # sync="window": the new buffer is released as the old was
                self._sharded.before_micro_batch(self._micro, self.accum_steps, slots.flat)

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
            if self._sharded is not None:
                self._sharded.before_micro_batch(self._micro, self.accum_steps, self._slots.flat)
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
        if self._sharded is not None:  # sync="window" and no reduce-scatter yet: no memory to write
            self._sharded.hold(flat, True)
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
        if self._sharded is not None:
            # FSDP2 already averaged over ranks: the scale is 1/accum_steps or world/total items.
            items = self._items + (self._items_t.item() if self._items_t is not None else 0.0)
            try:
                self._items, touched = self._sharded.agree(self._micro, self.accum_steps, items, touched)
            except _sharded.WindowDropped:  # lost on every rank alike: start the next one clean
                self._reset_window()
                raise
            self._items_t = None
        scale = self._window_scale(world)
        sumsq, nonfinite = ops.finalize_(flat, scale)
        parts = [sumsq, nonfinite.double()]
        if self._loss is not None:  # weighted as the gradient is: the same scale
            parts.append(self._loss * scale.double())
        # One host sync per window, for the flag, the norm and the loss.
        host = torch.stack(parts).tolist()
        if self._sharded is not None:
            # Summed over all shards: every rank clips alike, skips alike and logs the same loss.
            host = self._sharded.global_sums(host)
            if len(host) > 2:  # each rank's loss was scaled as FSDP2's rank-averaged gradient is
                host[2] /= self._sharded.world
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
                q.grad = _sharded.as_grad(g, q)
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
        if self._sharded is not None:
            self._sharded.discard()  # sync="window": FSDP2's unsharded gradients of this window
        self._slots.tick()  # what was folded so far belongs to no window
        self._reset_window()

    def _reset_window(self) -> None:
        self._micro = 0
        self._items, self._items_t = 0.0, None
        self._loss, self._pending = None, None
        self._slots.start_window()
        if self._sharded is not None:
            self._sharded.before_micro_batch(0, self.accum_steps, self._slots.flat)

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"gradaccel"`` entry.

        Returns:
            dict with ``"state"`` and ``"param_groups"`` (the inner optimizer's, over the masters
            where ``master_weights``) and ``"gradaccel"``: the fp32 masters, the window buffer,
            which parameters got a gradient this window, and the counters. Mid-window the
            buffer is a copy, so the dict stays a consistent snapshot after further steps;
            between windows it is None (nothing folded yet), and ``"numel"`` says its size.
            On a ``fully_shard`` model the window is one fp32 DTensor per parameter, always present,
            and the inner state has an entry per parameter, so that ``torch.distributed.checkpoint``
            saves every rank's shard and loads into a fresh optimizer's ``state_dict()``.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # as torch.optim.Optimizer does
            pre_hook(self)
        slots = self._slots
        unset = None
        touched = slots.touched()
        if self._sharded is None:
            sd = self.optimizer.state_dict()
            # Between windows the buffer holds nothing of use: not saved (a checkpoint saved at every
            # update, as Trainer's are, would carry 4 bytes per parameter for nothing).
            flat = slots.rowmajor(copy=True) if self._micro > 0 or any(touched) else None
        else:
            if self._micro and self._sharded.sync == "window":
                raise ValueError("sync='window': mid-window the gradients are FSDP2's unsharded ones, "
                                 "which a state dict cannot hold; save at the end of a window (after "
                                 "the step() that returned True) or use sync='micro_batch'")
            self._sharded.hold(slots.flat, True)  # sync="window" releases it between windows
            sd, unset = _sharded.inner_state_dict(self.optimizer, slots.targets)
            # A copy mid-window, and with sync="window", whose buffer is released between windows.
            flat = _sharded.window_dtensors(slots.rowmajor(copy=False), slots.offsets, slots.params,
                                            copy=self._micro > 0 or self._sharded.sync == "window")
        items = self._items + (self._items_t.item() if self._items_t is not None else 0.0)
        if self._sharded is not None:  # each rank's own count so far
            items = _sharded.items_dtensor(items, slots.params[0])
        sd["gradaccel"] = {
            "accum_steps": self.accum_steps,
            "normalize": self.normalize,
            "masters": [t if t is not p else None for p, t in zip(slots.params, slots.targets)],
            "flat": flat,
            "numel": slots.flat.numel(),
            "touched": touched,
            "micro": self._micro,
            "items": items,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
        }
        if self._sharded is not None:  # inner entries made up for DCP; dropped at load
            sd["gradaccel"]["unset"] = unset
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
        flat = extra["flat"]
        if self._sharded is not None:
            flat = _sharded.window_flat(flat, slots.params)
            self._sharded.hold(slots.flat, True)
        numel = flat.numel() if flat is not None else extra["numel"]
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
        inner = [q for group in self.optimizer.param_groups for q in group["params"]]
        unset = extra.get("unset")
        for q, drop in zip(inner, unset.tolist() if unset is not None else ()):
            if drop:
                self.optimizer.state.pop(q, None)
        with torch.no_grad():
            if flat is not None:  # else saved between windows: nothing folded to restore
                slots.load_rowmajor(flat)
            for p, t, m in zip(slots.params, slots.targets, extra["masters"]):
                if m is not None:
                    t.copy_(m)
                    p.copy_(t)
            slots.note_versions()
        self._micro = int(extra["micro"])
        slots.restart(self._micro, extra["touched"])
        items = extra["items"]
        # A DTensor of per-rank counts (fully_shard): only their sum matters at the window's end.
        self._items = float(_sharded.local(items).sum()) if torch.is_tensor(items) else float(items)
        self._items_t = None
        self.skipped_steps = int(extra["skipped_steps"])
        self.last_grad_norm = extra["last_grad_norm"]
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _check_accum_steps(accum_steps: Any) -> None:
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}")


class _Probe(torch.optim.Optimizer):
    pass


_SHARED = frozenset({"param_groups", "state", "defaults"})


def _optimizer_internals() -> dict[str, Any]:
    """What ``torch.optim.Optimizer.__init__`` sets on an instance besides the attributes the
    wrapper shares with its inner optimizer (hook dicts, flags), fresh from a real one.

    Optimizer.__init__ itself is not called on the wrapper: it would build param_groups of its
    own, and the contract is that the wrapper shares the inner optimizer's. Taking the rest from
    an instance, not from a list written here, keeps hooks and profiling working when a torch
    release adds an attribute.
    """
    probe = _Probe([torch.empty(0, requires_grad=True)], {})
    return {k: v for k, v in vars(probe).items() if k not in _SHARED}


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
