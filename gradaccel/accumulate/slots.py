"""The window gradient of ``FusedAccumOptimizer``: one flat fp32 buffer, a slice per parameter.

A post-accumulate-grad hook on each parameter folds its gradient into the parameter's slice as
soon as autograd has produced it, then frees ``param.grad``. Which parameters got a gradient in
the current window is told by a stamp per parameter against a shared micro-step clock, so the
buffer is never zeroed as a whole: a parameter's first gradient of a window overwrites its slice.
How the slices are laid out is in ``gradaccel/accumulate/flat.py``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradaccel import ops
from gradaccel.accumulate import flat as _flat
from gradaccel.accumulate.sharded import as_grad, local

# Which GradSlots folds each parameter, without writing onto the user's Parameters. By identity:
# a WeakKeyDictionary would compare tensors with ==, elementwise.
_OWNERS = WeakIdKeyDictionary()

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
DDP_HINT = (
    "a parameter's .grad was written after FusedAccumOptimizer folded it in the same backward. "
    "This is what DistributedDataParallel does (it all-reduces .grad after the fold hook), which "
    "would all-reduce every micro-batch and mix unreduced and reduced gradients. Do not wrap the "
    "model in DistributedDataParallel: build the optimizer on the plain model's parameters and "
    "pass process_group=<group> (e.g. torch.distributed.group.WORLD); FusedAccumOptimizer then "
    "all-reduces the fp32 window buffer once per window. Broadcast the initial parameters "
    "yourself (torch.distributed.broadcast) so that every rank starts equal."
)

RELEASED = (
    "FusedAccumOptimizer: a gradient arrived while the window buffer is released. With "
    "sync='window' only the backward of the window's last micro-batch reduce-scatters and folds: "
    "do not turn FSDP2's gradient sync on (set_requires_gradient_sync) or set .grad yourself "
    "earlier in the window, or use sync='micro_batch'"
)


def _check_live(view: torch.Tensor) -> None:
    """Refuses a write into a slice whose memory is released (sync="window"): it would write
    into freed memory."""
    if view.numel() and not view.untyped_storage().nbytes():
        raise RuntimeError(RELEASED)


def _make_hook(views: list, stamps: list, clock: list, i: int) -> Callable[[torch.Tensor], None]:
    # The hook holds no reference to the slots (only the shared lists), so a dropped optimizer
    # is collected and its __del__ removes the hooks. `views` is mutated in place when the flat
    # buffer grows (add_param_group), so the hook always folds into the live buffer.
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.layout is not torch.strided:
            raise RuntimeError("FusedAccumOptimizer: sparse gradients are not supported "
                               "(e.g. nn.Embedding(sparse=True)); use dense gradients")
        # detach: backward(create_graph=True) keeps values, not graphs; local: a DTensor grad
        # (fully_shard) folds this rank's shard into this rank's slice.
        grad = local(grad).detach()
        _check_live(views[i])
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


class _Sink:
    """What fuse_wgrad's layers call in backward instead of returning a weight gradient
    (gradaccel/accumulate/wgrad.py), with the fold hook's window bookkeeping. :meth:`open` gives
    the parameter's fp32 slice to add this micro-batch's gradient onto (what the C++
    ``fused_linear`` of a routed ``nn.Linear`` calls); ``sink(add)`` hands it to ``add``. Like
    the hook, it holds the shared lists, not the slots."""

    __slots__ = ("views", "stamps", "clock", "i")

    def __init__(self, views: list, stamps: list, clock: list, i: int) -> None:
        self.views, self.stamps, self.clock, self.i = views, stamps, clock, i

    def open(self) -> torch.Tensor:
        """The slice, zeroed first if this is the window's first gradient (it then still holds an
        earlier window's), and marked as written in this micro-batch."""
        # No _check_live: only sync="window" (FSDP2) releases the buffer, and fuse_wgrad neither
        # runs there nor routes a sharded weight. (The check costs µs a layer, every micro-batch.)
        view = self.views[self.i]
        if self.stamps[self.i] < self.clock[1]:
            view.zero_()
        self.stamps[self.i] = self.clock[0]
        return view

    def __call__(self, add: Callable[[torch.Tensor], None]) -> None:
        add(self.open())


class GradSlots:
    """Parameters, their fp32 slices of one flat buffer, their hooks and (optional) masters.

    ``targets[i]`` is what the inner optimizer updates for ``params[i]``: the parameter itself,
    or its fp32 master when ``master_weights`` and the parameter is bf16/fp16. The optimizer
    drives it through the methods below, each named for what it does to the window.
    """

    def __init__(self, master_weights: bool) -> None:
        self.master_weights = master_weights
        self.params: list[torch.Tensor] = []    # model parameters owning a slice, in order
        self.targets: list[torch.Tensor] = []   # what the inner optimizer updates: master or param
        self.offsets: list[int] = []
        self.views: list[torch.Tensor] = []     # shaped fp32 views into the flat buffer
        self.stamps: list[int] = []             # micro-step at which param i was last folded
        self.lowp: list[int] = []               # indices of parameters that have an fp32 master
        self.versions: list[int] = []           # their ._version after our last write
        # [micro-steps so far, micro-step at which the window began]; shared with the hooks.
        self.clock = [0, 0]
        self.frozen: list[torch.Tensor] = []    # requires_grad=False at adoption: no slice
        self.flat: torch.Tensor | None = None
        self._memory_order: list[list[int]] = []
        self._rowmajor = True
        self._handles: list = []
        self._index: dict[int, int] = {}

    # --- parameters -----------------------------------------------------------------------------
    def adopt(self, params: list[torch.Tensor], state: dict) -> list[torch.Tensor]:
        """Hooks new parameters; returns what the inner group must hold instead (masters).

        ``state`` is the inner optimizer's state: what it holds for a parameter moves to the
        parameter's master. Call :meth:`grow` afterwards; :meth:`forget_since` undoes.
        """
        device = self.params[0].device if self.params else None
        out = []
        for p in params:
            if id(p) in self._index or any(p is f for f in self.frozen):
                raise ValueError("a parameter appears twice in the parameter groups (in one group or in two)")
            if not p.requires_grad:
                # No slice for frozen parameters: an fp32 copy of a frozen base model would
                # cost memory for gradients that never come.
                self.frozen.append(p)
                out.append(p)
                continue
            if p.dtype not in _SUPPORTED:
                raise ValueError(f"FusedAccumOptimizer accumulates in fp32: parameters must be "
                                 f"float32, bfloat16 or float16, got {p.dtype}")
            device = device or p.device
            if p.device != device:
                raise ValueError(f"all parameters must be on one device (one flat buffer); "
                                 f"got {device} and {p.device}")
            owner = _OWNERS.get(p)
            other = owner() if owner is not None else None
            if other is not None and other is not self:
                warnings.warn("a parameter was managed by another FusedAccumOptimizer; its hooks "
                              "are removed and this one takes over", UserWarning, stacklevel=3)
                other.remove_hooks()
            _OWNERS[p] = weakref.ref(self)
            target = p
            if self.master_weights and p.dtype in _LOW_PRECISION:
                target = p.detach().clone().float()  # laid out like p, and so like its slice
                if p in state:  # what the inner optimizer already holds for p: fp32, for the master
                    state[target] = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                     for k, v in state.pop(p).items()}
            i = len(self.params)
            self._index[id(p)] = i
            self.params.append(p)
            self.targets.append(target)
            self.stamps.append(-1)
            self.versions.append(p._version)
            if target is not p:
                self.lowp.append(i)
            self._handles.append(p.register_post_accumulate_grad_hook(
                _make_hook(self.views, self.stamps, self.clock, i)))
            out.append(target)
        return out

    def sink_for(self, p: torch.Tensor) -> "_Sink | None":
        """For ``fuse_wgrad``: ``p``'s :class:`_Sink`, which gives its fp32 slice to add the
        micro-batch's gradient onto (``open()``, or ``sink(add)``) with the fold hook's window
        bookkeeping; None if ``p`` has no slice here."""
        i = self._index.get(id(p))
        if i is None or self.params[i] is not p:
            return None
        return _Sink(self.views, self.stamps, self.clock, i)

    def mark(self) -> tuple[int, int]:
        """How many parameters (trainable, frozen) are adopted now: for :meth:`forget_since`."""
        return len(self.params), len(self.frozen)

    def forget_since(self, mark: tuple[int, int]) -> None:
        """Undoes the adoptions made since :meth:`mark` returned ``mark``, hooks included."""
        n_params, n_frozen = mark
        for h in self._handles[n_params:]:
            h.remove()
        for p in self.params[n_params:]:
            del self._index[id(p)]
        for lst in (self.params, self.targets, self.stamps, self.versions, self._handles):
            del lst[n_params:]
        self.lowp[:] = [i for i in self.lowp if i < n_params]
        del self.frozen[n_frozen:]

    def grow(self) -> None:
        """(Re)allocates the flat fp32 buffer for all adopted parameters, keeping its content."""
        old = self.flat
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += local(p).numel()  # a DTensor's slice holds this rank's shard only
        device = self.params[0].device if self.params else torch.device("cpu")
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        if old is not None and old.numel() and old.untyped_storage().nbytes():  # not released
            flat[: old.numel()].copy_(old)
        self.flat, self.offsets = flat, offsets
        # In place: the hooks hold this very list.
        self.views[:] = [_flat.slice_like(flat, o, local(p)) for o, p in zip(offsets, self.params)]
        # A grad permuted this way flattens in its slice's memory order (what fold_ writes).
        self._memory_order = [_flat.memory_order(v) for v in self.views]
        self._rowmajor = all(v.is_contiguous() for v in self.views)  # state dicts copy as they are

    def remove_hooks(self) -> None:
        """Removes the fold hooks from every parameter (the wrapper is going)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __del__(self) -> None:
        try:
            self.remove_hooks()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass

    # --- .grad on the parameters ----------------------------------------------------------------
    def clear_grads(self, set_to_none: bool = True) -> None:
        """Clears ``.grad`` left on the parameters (set to None, or zeroed in place)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def fold_leftovers(self) -> None:
        """Folds grads that did not come through a hook (set by hand, or unfrozen later)."""
        now, start = self.clock
        late: dict[torch.dtype, tuple[list, list]] = {}
        # Checked before anything is cleared: a refusal loses no gradient.
        for p, v in zip(self.params, self.views):
            if p.grad is not None and p.grad.layout is not torch.strided:
                raise RuntimeError("FusedAccumOptimizer: sparse gradients are not supported; use dense ones")
            if p.grad is not None:
                _check_live(v)
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if self.stamps[i] == now:
                raise RuntimeError("FusedAccumOptimizer: " + DDP_HINT)
            if self.stamps[i] < start:
                self.views[i].zero_()  # the slice still holds an earlier window's values
            grads, offs = late.setdefault(g.dtype, ([], []))
            grads.append(local(g.detach()).permute(self._memory_order[i]))
            offs.append(self.offsets[i])
            p.grad = None
            self.stamps[i] = now
        for grads, offs in late.values():
            ops.fold_(self.flat, grads, offs, 1.0)
        for p in self.frozen:
            if p.grad is not None:
                raise RuntimeError("FusedAccumOptimizer: a parameter that had requires_grad=False "
                                   "when the optimizer was built now has a gradient; build the "
                                   "optimizer after changing requires_grad")

    # --- the window -----------------------------------------------------------------------------
    def tick(self) -> None:
        """Ends a micro-batch: later gradients belong to the next one."""
        self.clock[0] += 1

    def touched(self) -> list[bool]:
        """Per parameter: did it get a gradient in the current window."""
        return [s >= self.clock[1] for s in self.stamps]

    def zero_untouched(self, touched: list[bool]) -> None:
        """Zeroes the slices still holding an earlier window's values (see the hooks)."""
        for t, v in zip(touched, self.views):
            if not t:
                v.zero_()

    def start_window(self) -> None:
        """Starts a new window: what was folded so far belongs to none."""
        self.clock[1] = self.clock[0]

    def discard_window(self) -> None:
        """Drops the window in progress: ``.grad`` left on the parameters and every fold so far."""
        self.clear_grads()
        self.tick()  # what was folded so far belongs to no window
        self.start_window()

    def restart(self, micro: int, touched: list[bool]) -> None:
        """Resumes a window ``micro`` micro-batches in, in which ``touched`` parameters got grads."""
        self.clock[:] = [micro, 0]
        self.stamps[:] = [0 if t else -1 for t in touched]

    def finalize(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales the whole buffer in one pass; returns (sum of squares, non-finite flag), 0-d."""
        return ops.finalize_(self.flat, scale)

    def scale_(self, coef: float) -> None:
        """Multiplies the window gradient by ``coef`` (clipping)."""
        self.flat.mul_(coef)

    # --- the update -----------------------------------------------------------------------------
    def lend_grads(self, touched: list[bool]) -> None:
        """Gives each target touched this window its window gradient as ``.grad``.

        fp32 targets get views into the buffer. A bf16/fp16 parameter without a master gets the
        gradient rounded to its dtype in the first half of its own slice, not in a copy: the
        buffer's fp32 values of those slices are lost, so call this once, when the window is
        over. A parameter with no gradient in the whole window keeps ``.grad`` None, as in stock
        PyTorch, so the inner optimizer skips it (no decay, no momentum).
        """
        for t, q, v, o in zip(touched, self.targets, self.views, self.offsets):
            if not t:
                continue
            g = v if q.dtype == torch.float32 else _flat.narrow_in_place(self.flat, o, v, q.dtype)
            if g.stride() != q.stride():  # re-laid out since adoption (model.to(channels_last))
                g = torch.empty_like(local(q)).copy_(g)  # fused kernels pair elements by memory
            q.grad = as_grad(g, q)

    def take_grads_back(self) -> None:
        """Sets the targets' ``.grad`` back to None: they alias the buffer, and nothing but the
        buffer is held between windows."""
        for q in self.targets:
            q.grad = None

    # --- save and load --------------------------------------------------------------------------
    def rowmajor(self, copy: bool) -> torch.Tensor:
        """The buffer with every slice in its parameter's row-major order: what a state dict
        holds, so that it loads into a model of another memory layout. A copy if ``copy``, or
        if a slice is laid out otherwise."""
        if self._rowmajor:
            return self.flat.clone() if copy else self.flat
        return _flat.to_rowmajor(self.flat, self.offsets, self.views)

    def load_rowmajor(self, flat: torch.Tensor) -> None:
        """Fills the buffer from :meth:`rowmajor`'s layout."""
        if self._rowmajor:
            self.flat.copy_(flat)
        else:
            _flat.from_rowmajor(self.views, self.offsets, flat)

    def masters(self) -> list[torch.Tensor | None]:
        """Per parameter: its fp32 master, or None where the optimizer updates the parameter."""
        return [t if t is not p else None for p, t in zip(self.params, self.targets)]

    def load_masters(self, masters: list[torch.Tensor | None]) -> None:
        """Copies saved masters (:meth:`masters`) in, and rounds each into its parameter."""
        for p, t, m in zip(self.params, self.targets, masters):
            if m is not None:
                t.copy_(m)
                p.copy_(t)
        self.note_versions()

    # --- fp32 masters ---------------------------------------------------------------------------
    def sync_masters(self) -> None:
        """Re-reads masters from parameters changed in place since the last update.

        A parameter's version counter moves when something else writes it (model.load_state_dict,
        a manual edit); its master would otherwise overwrite that change at the next update. A
        write that left the parameter equal to its rounded master (the model's state dict loaded
        after the optimizer's, which restored the fp32 master) keeps the master's fp32 bits.
        """
        for i in self.lowp:
            p, master = self.params[i], self.targets[i]
            if p._version != self.versions[i]:
                if not torch.equal(local(p), local(master).to(p.dtype)):
                    local(master).copy_(local(p))
                self.versions[i] = p._version

    def write_back_masters(self) -> None:
        """Rounds each master into its bf16/fp16 parameter (to nearest even, like ``.to(dtype)``)."""
        if not self.lowp:
            return
        ps = [self.params[i] for i in self.lowp]
        torch._foreach_copy_([local(p) for p in ps], [local(self.targets[i]) for i in self.lowp])
        self.note_versions()

    def note_versions(self) -> None:
        """Records the parameters' versions after a write of ours (see :meth:`sync_masters`)."""
        self.versions[:] = [p._version for p in self.params]
