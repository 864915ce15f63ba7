"""The distributed half of a ``FusedAccumOptimizer`` window: who sums the ranks' gradients, when.

Two kinds, with one interface, chosen by :func:`window_sync` from the parameters:

- :class:`ReplicatedSync`, plain parameters: one process, or a replicated model with
  ``process_group=``, whose fp32 window buffer is all-reduced once per window, at its end.
  The fold hook fires before DistributedDataParallel's all-reduce would finish, so DDP itself
  is refused (see ``gradaccel/accumulate/slots.py``) and the buffer is reduced here instead. Before the
  all-reduce the ranks agree that they ended the same window alike (``gradaccel/accumulate/agree.py``):
  ranks that diverged fail with the reason instead of hanging.
- :class:`gradaccel.accumulate.sharded.ShardedWindow`, FSDP2 (``fully_shard``) DTensor parameters: FSDP2
  reduce-scatters, every micro-batch or once per window (``sync=``); see ``gradaccel/accumulate/sharded.py``.

The interface: ``before_micro_batch``, ``hold``, ``cover``, ``discard`` (for what FSDP2 holds
between micro-batches), ``reduce`` (at the end of a window: sum the buffer and the item counts
over ranks, agree on which parameters got a gradient) and ``combine`` (make the norm, the
non-finite flag and the loss global), and ``sharded`` and ``process_group()``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from gradaccel.accumulate import sharded as _sharded
from gradaccel.accumulate.agree import WindowAgreement
from gradaccel.accumulate.window import WindowNorm


class ReplicatedSync:
    """Plain parameters: nothing to sync in one process; with ``process_group``, one all-reduce
    of the window buffer per window, averaged over ranks by the window's scale.

    Args:
        process_group: a ``torch.distributed`` group, or None (one process).
    """

    sharded = False
    sync = None

    def __init__(self, process_group: Any = None) -> None:
        # Weakly: a process group still referenced at interpreter exit is torn down there, which
        # aborts gloo processes about half the time after destroy_process_group().
        self._group = None if process_group is None else weakref.ref(process_group)
        self.agreement = None if process_group is None else WindowAgreement(process_group)
        # Backward passes this window, where a framework's loop steps once per window
        # (gradaccel.hf counts them); None: the optimizer's own micro-step count is the count.
        self.backwards: int | None = None

    def process_group(self) -> Any:
        """The group the buffer is all-reduced over (None: one process, or it was destroyed)."""
        return self._group() if self._group is not None else None

    def before_micro_batch(self, micro: int, accum_steps: int, flat: torch.Tensor) -> None:
        """Nothing: a replicated buffer is reduced only at the end of the window."""

    @staticmethod
    def hold(flat: torch.Tensor, needed: bool) -> None:
        """Nothing: a replicated buffer always holds its memory."""

    def cover(self, params: list[torch.Tensor]) -> None:
        """Nothing to check for new parameters."""

    def discard(self) -> None:
        """Nothing is held outside the buffer; the window's backward count restarts."""
        if self.backwards is not None:
            self.backwards = 0

    def count_backward(self) -> None:
        """Counts a backward pass (a micro-batch) of a loop that steps once per window."""
        if self.agreement is not None:  # only the ranks' check at the window's end reads it
            self.backwards = (self.backwards or 0) + 1

    def reduce(self, flat: torch.Tensor, micro: int, accum_steps: int, norm: WindowNorm,
               touched: list[bool]) -> tuple[int, list[bool]]:
        """Sums the buffer, the item counts and the touched flags over the ranks.

        Args:
            flat: the window buffer (summed in place).
            micro, accum_steps: where the window is (unused: the ranks meet in the all-reduce).
            norm: the window's counts; it gets the total over all ranks.
            touched: per parameter, whether it got a gradient here this window.

        Returns:
            (the number of ranks summed, for the window's scale; touched on any rank).
        """
        if self._group is None:
            return 1, touched
        group = self._group()
        if group is None:
            raise RuntimeError("FusedAccumOptimizer: its process_group was destroyed; "
                               "build a new optimizer for the new group")
        world = dist.get_world_size(group)
        # Checked on every rank before the sum: diverged ranks fail with the reason, not a hang.
        self.agreement.agree(accum_steps if self.backwards is None else self.backwards, flat.numel())
        if self.backwards is not None:
            self.backwards = 0
        # Items and "who got a gradient" travel in one small fp64 all-reduce: every rank must
        # hand the same parameters to the inner optimizer, or they would drift apart.
        meta = torch.tensor([0.0] + [float(t) for t in touched], dtype=torch.float64, device=flat.device)
        norm.add_items_to(meta[0])
        dist.all_reduce(flat, group=group)
        dist.all_reduce(meta, group=group)
        host = meta.tolist()
        norm.set_items(host[0])
        return world, [t > 0 for t in host[1:]]

    def combine(self, host: list[float]) -> list[float]:
        """The window's (sum of squares, non-finite flag, loss...) as they are: the buffer was
        all-reduced, so every rank has the same."""
        return host


def window_sync(params: list[torch.Tensor], process_group: Any, sync: str, module: Any):
    """The sync object for ``params`` (all the optimizer's parameters, frozen ones included).

    Returns:
        A :class:`gradaccel.accumulate.sharded.ShardedWindow` for DTensor (``fully_shard``) parameters,
        else a :class:`ReplicatedSync`.

    Raises:
        ValueError: ``sync=`` or ``module=`` given for plain parameters, and what
            :func:`gradaccel.accumulate.sharded.check_params` and ``ShardedWindow`` refuse.
    """
    if _sharded.check_params(params, process_group):
        return _sharded.ShardedWindow([p for p in params if p.requires_grad], sync, module)
    if sync != "micro_batch" or module is not None:
        raise ValueError("sync= and module= are for fully_shard (FSDP2) models; these parameters "
                         "are plain tensors (for data parallelism use process_group=)")
    return ReplicatedSync(process_group)
