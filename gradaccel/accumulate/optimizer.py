"""``FusedAccumOptimizer``: exact gradient accumulation in one flat fp32 buffer.

The training loop stays the stock one (``loss.backward(); opt.step(); opt.zero_grad()`` every
micro-batch). A post-accumulate-grad hook on each parameter folds its gradient into that
parameter's slice of one flat fp32 buffer as soon as autograd has produced it, then frees
``param.grad``; the ``step()`` that ends a window of ``accum_steps`` micro-batches makes one
finalize pass over the buffer (late scale, non-finite flag, sum of squares), optionally clips,
and runs the wrapped optimizer on fp32 gradients (or fp32 master weights).

The parts, each in its own module: the buffer, its slices and hooks (``slots.py``, laid out by
``flat.py``), window normalisation (``window.py``), distributed sync (``sync.py``, with
``sharded.py`` for FSDP2), save/load (``state_dict.py``), and what a framework's own loop calls
(``framework.py``: Hugging Face Trainer and accelerate, through ``gradaccel.hf``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradaccel.accumulate import sharded as _sharded
from gradaccel.accumulate import state_dict as _state_dict
from gradaccel.accumulate import wgrad as _wgrad
from gradaccel.accumulate.framework import FrameworkLoop
from gradaccel.accumulate.slots import GradSlots
from gradaccel.accumulate.sync import window_sync
from gradaccel.accumulate.window import WindowNorm, WindowScheduler, check_accum_steps
from gradaccel.ops import extension

__all__ = ["FusedAccumOptimizer", "WindowScheduler"]


class FusedAccumOptimizer(FrameworkLoop, torch.optim.Optimizer):
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
            per window and averaged over ranks. Use on a plain (not DDP-wrapped) model. Before
            the sum the ranks check, through the process group's store, that they ended the
            same window with as many micro-batches; ranks that diverged raise RuntimeError
            (at once, or after the process group's timeout), never hang.
        sync: for an FSDP2 (``fully_shard``) model, whose parameters are DTensors: when FSDP2
            reduce-scatters. ``"micro_batch"`` (default): after every backward, folding the
            shard at once (least memory). ``"window"``: FSDP2 holds fp32 unsharded gradients for
            the window and reduce-scatters once, in the backward of the window's last
            micro-batch, which every rank must run (least communication); needs ``module``.
            The buffer holds this rank's shards only. Build the optimizer on every rank: it
            makes a small gloo group for the end-of-window check. See ``gradaccel/accumulate/sharded.py``.
        module: the model: the ``fully_shard``-ed root module (needed for ``sync="window"``), or
            the plain model whose layers ``fuse_wgrad`` routes.
        fuse_wgrad: route the weight gradients of the ``nn.Linear`` and ``nn.Embedding`` layers
            of ``module`` (needed) straight into the fp32 window: their backward adds
            ``dyᵀ @ x`` (rows ``dy`` at ``ids``) onto the weight's slice, products summed in
            fp32, and makes no weight-sized gradient (``gradaccel.ops.wgrad_accumulate_``,
            ``embedding_accumulate_``). Every other parameter keeps the fold. A routed weight's
            ``.grad`` stays None (its post-accumulate-grad hooks fire and see None). Not with
            FSDP2 (``fully_shard``). See docs/accumulation.md.

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
        parameters and masters (a bf16/fp16 parameter without a master gets its gradient rounded
        to its dtype in place, in its own slice: no gradient-sized copy); they are set back to
        None afterwards, so nothing but the buffer is held between windows. A parameter that got no gradient in a window keeps ``.grad`` None, as in
        stock PyTorch. Parameters with ``requires_grad=False`` at construction get no slice.
        A bf16/fp16 parameter written in place outside the optimizer (``model.load_state_dict``)
        is re-read into its master before the next update. ``add_param_group`` must be called on
        the wrapper, not the inner optimizer. The hooks go when the wrapper is collected.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accum_steps: int, *,
                 normalize: str = "mean", max_grad_norm: float | None = None,
                 master_weights: bool = False, process_group: Any = None,
                 sync: str = "micro_batch", module: Any = None, fuse_wgrad: bool = False) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, FusedAccumOptimizer):
            raise TypeError("optimizer is already a FusedAccumOptimizer; wrap the inner optimizer once")
        if _needs_closure(optimizer):
            raise TypeError(f"{type(optimizer).__name__}.step() needs a closure that it calls again and "
                            "again on one batch (a line search): it cannot accumulate over micro-batches")
        check_accum_steps(accum_steps)
        norm = WindowNorm(normalize)  # checks normalize
        if max_grad_norm is not None:
            if (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                    or math.isnan(max_grad_norm) or max_grad_norm <= 0):
                raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
            max_grad_norm = float(max_grad_norm)
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
        if not isinstance(fuse_wgrad, bool):
            raise TypeError(f"fuse_wgrad must be a bool, got {type(fuse_wgrad).__name__}")
        if fuse_wgrad and not isinstance(module, torch.nn.Module):
            raise ValueError("fuse_wgrad=True needs module=<the model>: the nn.Linear and nn.Embedding "
                             "layers whose weight gradients it routes into the window")
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialized; "
                             "call torch.distributed.init_process_group first")
        extension.load()  # built here, on its first use, never inside a training step or a Dynamo trace

        self.optimizer = optimizer
        self.__dict__.update(_optimizer_internals())
        self._patch_step_function()  # profiles and hooks this class's step(), as Optimizer.__init__ does

        self._micro = 0
        self._slots = GradSlots(master_weights)  # the buffer, a slice and a hook per parameter
        self._norm = norm                        # the window's item count, loss and late scale
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if fuse_wgrad and any(_sharded.is_dtensor(p) for p in params):
            raise ValueError("fuse_wgrad=True is not supported on fully_shard (FSDP2) models: their "
                             "weights are DTensor shards, and FSDP2 reduce-scatters the .grad that "
                             "fuse_wgrad never makes. Use fuse_wgrad=False (the fold) with FSDP2")
        # who sums the ranks' windows (module= is the model to route, not an FSDP2 root, here)
        self._sync = window_sync(params, process_group, sync, None if fuse_wgrad else module)
        self._accum_steps = accum_steps  # not the setter: the sync hears of it once the buffer exists
        self.max_grad_norm = max_grad_norm
        self.master_weights = master_weights
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.window_loss: float | None = None
        self._pending: tuple | None = None  # (norm, touched, finite) of a window finalized by clip_grad_norm_
        self._warned_empty = False
        for group in optimizer.param_groups:
            group["params"] = self._slots.adopt(group["params"], optimizer.state)
        self._slots.grow()
        self._sync.before_micro_batch(0, accum_steps, self._slots.flat)
        self.fuse_wgrad = fuse_wgrad
        # (layer, name) of each routed layer; handed back to the model when the wrapper goes.
        self._fuse_root = module if fuse_wgrad else None
        self._routed = _wgrad.route(module, self._slots.sink_for) if fuse_wgrad else []

    @property
    def fused_layers(self) -> list[str]:
        """Qualified names of the layers whose weight gradients ``fuse_wgrad`` routes."""
        return [name for _, name in self._routed]

    def __del__(self) -> None:
        try:
            self._unroute()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass

    def _unroute(self) -> None:
        routed = self.__dict__.get("_routed")
        if routed:
            _wgrad.unroute(routed)
            self._routed = []

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
    def normalize(self) -> str:
        """``"mean"``, ``"items"`` or ``"sum"``: what the window gradient is divided by."""
        return self._norm.normalize

    @normalize.setter
    def normalize(self, value: str) -> None:
        self._norm.normalize = WindowNorm(value).normalize  # checked as the constructor checks it

    @property
    def accum_steps(self) -> int:
        """Micro-batches per window; may be changed between windows."""
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        check_accum_steps(value)
        self._accum_steps = value
        # sync="window": which backward reduce-scatters moves with it
        self._sync.before_micro_batch(self._micro, value, self._slots.flat)

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat fp32 window buffer (1-D; parameter i's slice in adoption order). Read only.
        With ``sync="window"`` its memory is released until the window's last micro-batch; after
        an update its content is undefined until the next window's gradients arrive."""
        return self._slots.flat

    @property
    def micro_step(self) -> int:
        """Micro-batches already stepped in the current window (0 .. accum_steps-1)."""
        return self._micro

    def per_window(self, scheduler: Any) -> WindowScheduler:
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
        # The constructor's rule for the whole set: all DTensors on one mesh, or all plain.
        if _sharded.check_params(slots.params + params, self._sync.process_group()) != self._sync.sharded:
            raise ValueError("add_param_group: these parameters are DTensors (fully_shard) and the "
                             "optimizer's are plain tensors, or the other way round; build one "
                             "optimizer per kind")
        self._sync.cover([p for p in params if p.requires_grad])
        mark = slots.mark()
        try:
            group["params"] = slots.adopt(list(params), self.optimizer.state)
            self.optimizer.add_param_group(group)
        except Exception:
            slots.forget_since(mark)  # no hooks left behind for a refused group
            raise
        if slots.mark()[0] != mark[0]:
            slots.grow()
            if self._fuse_root is not None:  # the new weights' layers, not routed yet
                self._routed += _wgrad.route(self._fuse_root, slots.sink_for)
            # sync="window": the new buffer is released as the old was
            self._sync.before_micro_batch(self._micro, self.accum_steps, slots.flat)

    # --- the training loop ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears any ``.grad`` left on the parameters; never the window being accumulated.

        Args:
            set_to_none: set grads to None (default) rather than zeroing them in place.
        """
        self._slots.clear_grads(set_to_none)

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
        self._norm.count(num_items, self._slots.flat.device)
        if closure is not None:
            with torch.enable_grad():
                closure()
        if loss is not None:
            self._add_loss(loss)
        self._slots.fold_leftovers()
        self._slots.tick()
        self._micro += 1
        if self._micro < self.accum_steps:
            self._sync.before_micro_batch(self._micro, self.accum_steps, self._slots.flat)
            return False
        return self._end_window()

    def _add_loss(self, loss: torch.Tensor | float) -> None:
        self._norm.add_loss(loss, self._slots.flat.device)

    def _finalize(self) -> tuple[float, list[bool], bool]:
        """Reduces, scales and measures the window's gradient. Returns (norm, touched, finite)."""
        slots, flat = self._slots, self._slots.flat
        touched = slots.touched()
        self._sync.hold(flat, True)  # sync="window" and no reduce-scatter yet: no memory to write
        slots.zero_untouched(touched)
        try:
            world, touched = self._sync.reduce(flat, self._micro, self.accum_steps, self._norm, touched)
        except _sharded.WindowDropped:  # lost on every rank alike: start the next one clean
            self._reset_window()
            raise
        scale = self._norm.scale(self.accum_steps, world, flat.device)
        sumsq, nonfinite = slots.finalize(scale)
        parts = [sumsq, nonfinite.double()]
        loss = self._norm.loss
        if loss is not None:  # weighted as the gradient is: the same scale
            parts.append(loss * scale.double())
        # One host sync per window, for the flag, the norm and the loss.
        ss, nf, *rest = self._sync.combine(torch.stack(parts).tolist())
        self.window_loss = rest[0] if rest else None
        norm = math.sqrt(ss) if ss >= 0 else float("nan")
        self.last_grad_norm = norm
        return norm, touched, not nf and math.isfinite(norm)

    def _clip(self, norm: float, max_norm: float) -> None:
        coef = max_norm / (norm + 1e-6)  # the same epsilon as clip_grad_norm_
        if coef < 1.0:
            self._slots.scale_(coef)

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
            self._clip(norm, clip)
        self._apply(touched)
        self._reset_window()
        return True

    def _apply(self, touched: list[bool]) -> None:
        slots = self._slots
        slots.sync_masters()
        slots.lend_grads(touched)
        self.optimizer.step()
        slots.take_grads_back()
        slots.write_back_masters()

    def reset_window(self) -> None:
        """Discards the window in progress: every gradient folded since the last update.

        For a micro-batch whose backward failed halfway (out of memory, say): its gradients
        are already in the buffer, mixed with the window's, and cannot be taken out alone.
        ``zero_grad()`` leaves the window alone by design; this drops it. The next micro-batch
        starts a new window.
        """
        self._slots.discard_window()
        self._sync.discard()  # sync="window": FSDP2's unsharded gradients of this window
        self._reset_window()

    def _reset_window(self) -> None:
        self._micro = 0
        self._norm.reset()
        self._pending = None
        self._slots.start_window()
        self._sync.before_micro_batch(0, self.accum_steps, self._slots.flat)

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
        sd = _state_dict.save(self.optimizer, self._slots, self._sync, accum_steps=self.accum_steps,
                              normalize=self.normalize, micro=self._micro, items=self._norm.items(),
                              skipped_steps=self.skipped_steps, last_grad_norm=self.last_grad_norm)
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
        counters = _state_dict.load(state_dict, self.optimizer, self._slots, self._sync,
                                    accum_steps=self.accum_steps, normalize=self.normalize)
        self._micro = counters["micro"]
        self._norm.set_items(counters["items"])
        self.skipped_steps = counters["skipped_steps"]
        self.last_grad_norm = counters["last_grad_norm"]
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


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
