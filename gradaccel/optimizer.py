"""``FusedAccumOptimizer``: exact gradient accumulation in one flat fp32 buffer.

The training loop stays the stock one (``loss.backward(); opt.step(); opt.zero_grad()`` every
micro-batch). A post-accumulate-grad hook on each parameter folds its gradient into that
parameter's slice of one flat fp32 buffer as soon as autograd has produced it, then frees
``param.grad``; the ``step()`` that ends a window of ``accum_steps`` micro-batches makes one
finalize pass over the buffer (late scale, non-finite flag, sum of squares), optionally clips,
and runs the wrapped optimizer on fp32 gradients (or fp32 master weights).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradaccel import ops

__all__ = ["FusedAccumOptimizer"]

_NORMALIZE = ("mean", "items")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_DDP_HINT = (
    "a parameter's .grad was written after FusedAccumOptimizer folded it in the same backward. "
    "This is what DistributedDataParallel does (it all-reduces .grad after the fold hook), which "
    "would all-reduce every micro-batch and mix unreduced and reduced gradients. Do not wrap the "
    "model in DistributedDataParallel: build the optimizer on the plain model's parameters and "
    "pass process_group=<group> (e.g. torch.distributed.group.WORLD); FusedAccumOptimizer then "
    "all-reduces the fp32 window buffer once per window. Broadcast the initial parameters "
    "yourself (torch.distributed.broadcast) so that every rank starts equal."
)


def _make_hook(views: list, stamps: list, clock: list, i: int) -> Callable[[torch.Tensor], None]:
    # The hook holds no reference to the optimizer (only the shared lists), so a dropped wrapper
    # is collected and its __del__ removes the hooks. `views` is mutated in place when the flat
    # buffer grows (add_param_group), so the hook always folds into the live buffer.
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.layout is not torch.strided:
            raise RuntimeError("FusedAccumOptimizer: sparse gradients are not supported "
                               "(e.g. nn.Embedding(sparse=True)); use dense gradients")
        if stamps[i] < clock[1]:
            # First arrival in this window: a converting copy overwrites the stale slice, which
            # saves zeroing the whole buffer every window (and reading it back here).
            views[i].copy_(grad)
        else:
            ops.scale_accumulate_(views[i], grad, 1.0)
        # Freeing the grad here is the memory win: no per-parameter .grad survives the backward.
        param.grad = None
        stamps[i] = clock[0]
    return hook


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
            window's total item count (across ranks with ``process_group``).
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

        self._params: list[torch.Tensor] = []    # model parameters owning a slice, in order
        self._targets: list[torch.Tensor] = []   # what the inner optimizer updates: master or param
        self._offsets: list[int] = []
        self._views: list[torch.Tensor] = []     # shaped fp32 views into the flat buffer
        self._stamps: list[int] = []             # micro-step at which param i was last folded
        self._lowp: list[int] = []               # indices of parameters that have an fp32 master
        self._versions: list[int] = []           # their ._version after our last write
        # [micro-steps so far, micro-step at which the window began]; shared with the hooks.
        self._clock = [0, 0]
        self._handles: list = []
        self._index: dict[int, int] = {}
        self._frozen: list[torch.Tensor] = []    # requires_grad=False at adoption: no slice
        self._flat: torch.Tensor | None = None
        self._micro = 0
        self._items = 0.0
        self._items_t: torch.Tensor | None = None
        self._mean_scale: torch.Tensor | None = None

        for group in optimizer.param_groups:
            group["params"] = self._adopt(group["params"])
        self._grow_flat()

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
        return self._flat

    @property
    def micro_step(self) -> int:
        """Micro-batches already stepped in the current window (0 .. accum_steps-1)."""
        return self._micro

    def __getstate__(self):
        # The base class would pickle only defaults/state/param_groups and unpickle into a
        # wrapper with no buffer and no hooks: fail loudly instead.
        raise TypeError("FusedAccumOptimizer holds hooks on its parameters and cannot be pickled "
                        "or deep-copied; save and load state_dict() instead")

    def __repr__(self) -> str:
        return (f"FusedAccumOptimizer(accum_steps={self.accum_steps}, normalize={self.normalize!r}, "
                f"max_grad_norm={self.max_grad_norm}, master_weights={self.master_weights})\n"
                + repr(self.optimizer))

    # --- parameters, hooks and the flat buffer -------------------------------------------------
    def _adopt(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Registers hooks for new parameters; returns what the inner group must hold instead."""
        device = self._params[0].device if self._params else None
        out = []
        for p in params:
            if id(p) in self._index or any(p is f for f in self._frozen):
                raise ValueError("some parameters appear in more than one parameter group")
            if not p.requires_grad:
                # No slice for frozen parameters: an fp32 copy of a frozen base model would
                # cost memory for gradients that never come.
                self._frozen.append(p)
                out.append(p)
                continue
            if p.dtype not in _SUPPORTED:
                raise ValueError(f"FusedAccumOptimizer accumulates in fp32: parameters must be "
                                 f"float32, bfloat16 or float16, got {p.dtype}")
            device = device or p.device
            if p.device != device:
                raise ValueError(f"all parameters must be on one device (one flat buffer); "
                                 f"got {device} and {p.device}")
            owner = getattr(p, "_gradaccel_owner", None)
            other = owner() if owner is not None else None
            if other is not None and other is not self:
                warnings.warn("a parameter was managed by another FusedAccumOptimizer; its hooks "
                              "are removed and this one takes over", UserWarning, stacklevel=3)
                other._remove_hooks()
            p._gradaccel_owner = weakref.ref(self)
            target = p
            if self.master_weights and p.dtype in _LOW_PRECISION:
                target = p.detach().clone(memory_format=torch.contiguous_format).float()
                # State the inner optimizer already holds for p moves to the master.
                if p in self.optimizer.state:
                    self.optimizer.state[target] = self.optimizer.state.pop(p)
            i = len(self._params)
            self._index[id(p)] = i
            self._params.append(p)
            self._targets.append(target)
            self._stamps.append(-1)
            self._versions.append(p._version)
            if target is not p:
                self._lowp.append(i)
            self._handles.append(p.register_post_accumulate_grad_hook(
                _make_hook(self._views, self._stamps, self._clock, i)))
            out.append(target)
        return out

    def _grow_flat(self) -> None:
        """(Re)allocates the flat fp32 buffer for all adopted parameters, keeping its content."""
        old = self._flat
        offsets, total = [], 0
        for p in self._params:
            offsets.append(total)
            total += p.numel()
        device = self._params[0].device if self._params else torch.device("cpu")
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        if old is not None and old.numel():
            flat[: old.numel()].copy_(old)
        self._flat, self._offsets = flat, offsets
        # In place: the hooks hold this very list.
        self._views[:] = [flat[o: o + p.numel()].view(p.shape) for o, p in zip(offsets, self._params)]

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __del__(self) -> None:
        try:
            self._remove_hooks()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass

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
        n_params, n_frozen = len(self._params), len(self._frozen)
        try:
            group["params"] = self._adopt(list(params))
            self.optimizer.add_param_group(group)
        except Exception:
            # Leave no hooks behind for a group the inner optimizer refused.
            for h in self._handles[n_params:]:
                h.remove()
            for p in self._params[n_params:]:
                del self._index[id(p)]
            for lst in (self._params, self._targets, self._stamps, self._versions, self._handles):
                del lst[n_params:]
            self._lowp[:] = [i for i in self._lowp if i < n_params]
            del self._frozen[n_frozen:]
            raise
        if len(self._params) != n_params:
            self._grow_flat()

    # --- the training loop ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears any ``.grad`` left on the parameters; never the window being accumulated.

        Args:
            set_to_none: set grads to None (default) rather than zeroing them in place.
        """
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def _fold_leftovers(self) -> None:
        """Folds grads that did not come through a hook (set by hand, or unfrozen later)."""
        now = self._clock[0]
        late: dict[torch.dtype, tuple[list, list]] = {}
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            if self._stamps[i] == now:
                raise RuntimeError("FusedAccumOptimizer: " + _DDP_HINT)
            if self._stamps[i] < self._clock[1]:
                self._views[i].zero_()  # the slice still holds an earlier window's values
            grads, offs = late.setdefault(g.dtype, ([], []))
            grads.append(g)
            offs.append(self._offsets[i])
            p.grad = None
            self._stamps[i] = now
        for grads, offs in late.values():
            ops.fold_(self._flat, grads, offs, 1.0)
        for p in self._frozen:
            if p.grad is not None:
                raise RuntimeError("FusedAccumOptimizer: a parameter that had requires_grad=False "
                                   "when the optimizer was built now has a gradient; build the "
                                   "optimizer after changing requires_grad")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, num_items: int | float | torch.Tensor | None = None) -> bool:
        """Ends a micro-batch; the call that ends a window applies the update.

        Args:
            closure: optional; called (with grad enabled) to compute the loss and run backward.
            num_items: items (e.g. tokens) in this micro-batch's summed loss; required with
                ``normalize="items"``, not accepted otherwise. An int/float or a 0-d tensor (a
                tensor is accumulated on its device, without a host sync).

        Returns:
            True when this call ended a window and applied an update; False otherwise (mid-window,
            or a window skipped because its gradient was not finite).
        """
        if self.normalize == "items":
            if num_items is None:
                raise ValueError('normalize="items" needs step(num_items=n): the number of items '
                                 "(e.g. tokens) summed in this micro-batch's loss")
            if isinstance(num_items, torch.Tensor):
                n = num_items.detach().to(device=self._flat.device, dtype=torch.float64)
                self._items_t = n if self._items_t is None else self._items_t + n
            elif isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items >= 0:
                raise ValueError(f"num_items must be a number >= 0 or a tensor, got {num_items!r}")
            else:
                self._items += num_items
        elif num_items is not None:
            raise ValueError('num_items is only used with normalize="items"; this optimizer '
                             f"normalizes by {self.normalize!r}")
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._fold_leftovers()
        self._clock[0] += 1
        self._micro += 1
        if self._micro < self.accum_steps:
            return False
        return self._end_window()

    def _window_scale(self, world: int) -> torch.Tensor:
        flat = self._flat
        if self.normalize == "mean":
            if self._mean_scale is None:
                # torch.full, not torch.tensor: no host-to-device copy on CUDA.
                self._mean_scale = torch.full((), 1.0 / (self.accum_steps * world),
                                              dtype=torch.float32, device=flat.device)
            return self._mean_scale
        total = torch.full((), self._items, dtype=torch.float64, device=flat.device)
        if self._items_t is not None:
            total = total + self._items_t
        return total.reciprocal().float()

    def _end_window(self) -> bool:
        flat = self._flat
        touched = [s >= self._clock[1] for s in self._stamps]
        for t, v in zip(touched, self._views):
            if not t:
                v.zero_()  # stale from an earlier window (the hooks overwrite on first arrival)
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
        # One host sync per window, for both the flag and the norm.
        ss, nf = torch.stack([sumsq.float(), nonfinite.float()]).tolist()
        norm = math.sqrt(ss) if ss >= 0 else float("nan")
        self.last_grad_norm = norm
        if nf or not math.isfinite(norm):
            self.skipped_steps += 1
            warnings.warn(f"FusedAccumOptimizer: non-finite gradient in this window (norm={norm}; "
                          "with normalize='items' also check num_items > 0); update skipped "
                          f"({self.skipped_steps} skipped so far)", UserWarning, stacklevel=3)
            self._reset_window()
            return False
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + 1e-6)  # the same epsilon as clip_grad_norm_
            if coef < 1.0:
                flat.mul_(coef)
        self._apply(touched)
        self._reset_window()
        return True

    def _apply(self, touched: list[bool]) -> None:
        self._sync_masters()
        targets, views = self._targets, self._views
        for t, q, v in zip(touched, targets, views):
            # A parameter with no gradient in the whole window keeps grad None, as in stock
            # PyTorch, so the inner optimizer skips it (no decay, no momentum).
            if t:
                q.grad = v if q.dtype == torch.float32 else v.to(q.dtype)
        self.optimizer.step()
        for q in targets:
            q.grad = None  # the views alias the buffer; drop them so nothing is held between windows
        if self._lowp:
            ps = [self._params[i] for i in self._lowp]
            torch._foreach_copy_(ps, [targets[i] for i in self._lowp])  # round to nearest even, like .to(dtype)
            for i, p in zip(self._lowp, ps):
                self._versions[i] = p._version

    def _sync_masters(self) -> None:
        """Re-reads masters from parameters changed in place since the last update.

        A parameter's version counter moves when something else writes it (model.load_state_dict,
        a manual edit); its master would otherwise overwrite that change at the next update.
        """
        for i in self._lowp:
            p = self._params[i]
            if p._version != self._versions[i]:
                self._targets[i].copy_(p)
                self._versions[i] = p._version

    def _reset_window(self) -> None:
        self._micro = 0
        self._items, self._items_t = 0.0, None
        self._clock[1] = self._clock[0]

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"gradaccel"`` entry.

        Returns:
            dict with ``"state"`` and ``"param_groups"`` (the inner optimizer's, over the masters
            where ``master_weights``) and ``"gradaccel"``: the fp32 masters, the window buffer,
            which parameters got a gradient this window, and the counters.
        """
        sd = self.optimizer.state_dict()
        items = self._items + (self._items_t.item() if self._items_t is not None else 0.0)
        sd["gradaccel"] = {
            "accum_steps": self.accum_steps,
            "normalize": self.normalize,
            "masters": [t if t is not p else None for p, t in zip(self._params, self._targets)],
            "flat": self._flat,
            "touched": [s >= self._clock[1] for s in self._stamps],
            "micro": self._micro,
            "items": items,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a ``state_dict()``, including a window in progress.

        Args:
            state_dict: from ``state_dict()`` of a wrapper over the same parameters.
        """
        sd = dict(state_dict)
        extra = sd.pop("gradaccel", None)
        if extra is None:
            raise ValueError("state_dict has no 'gradaccel' entry: it was not saved by "
                             "FusedAccumOptimizer.state_dict() (load the inner optimizer's own "
                             "state dict into opt.optimizer instead)")
        if extra["flat"].numel() != self._flat.numel() or len(extra["masters"]) != len(self._params):
            raise ValueError("state_dict was saved for different parameters "
                             f"({extra['flat'].numel()} elements, this optimizer has {self._flat.numel()})")
        if any((m is None) != (t is p) for p, t, m in zip(self._params, self._targets, extra["masters"])):
            raise ValueError("state_dict was saved with another master_weights setting or dtypes")
        self.optimizer.load_state_dict(sd)
        with torch.no_grad():
            self._flat.copy_(extra["flat"])
            for p, t, m in zip(self._params, self._targets, extra["masters"]):
                if m is not None:
                    t.copy_(m)
                    p.copy_(t)
            self._versions[:] = [p._version for p in self._params]
        self._micro = int(extra["micro"])
        self._clock[0] = self._micro
        self._clock[1] = 0
        self._stamps[:] = [0 if t else -1 for t in extra["touched"]]
        self._items, self._items_t = float(extra["items"]), None
        self.skipped_steps = int(extra["skipped_steps"])
        self.last_grad_norm = extra["last_grad_norm"]
