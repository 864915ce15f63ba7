"""Window normalisation for ``FusedAccumOptimizer``: what the window's summed gradient is divided by.

``normalize="mean"``: each micro-batch loss is a mean and the window gradient is their mean, so
the scale is ``1 / accum_steps``. ``"items"``: each loss is a sum over items (tokens), every
``step(num_items=n)`` says how many, and the scale is ``1 / total items``. ``"sum"``: the losses
are already scaled, and the scale is 1. With data parallelism the scale also divides by the
number of ranks whose buffers were summed.

The scale is applied late, once per window, by the finalize pass over the buffer; the window's
loss, when ``step(loss=...)`` hands it in, is weighted by the same scale. Counts and losses given
as tensors are summed on their device, without a host sync.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

NORMALIZE = ("mean", "items", "sum")


def check_accum_steps(accum_steps: Any) -> None:
    """Raises ValueError unless ``accum_steps`` is an int >= 1 (bool refused)."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}")


class WindowNorm:
    """The item count and loss of the window in progress, and the window's late scale.

    Args:
        normalize: ``"mean"``, ``"items"`` or ``"sum"`` (see the module docstring).

    Raises:
        ValueError: ``normalize`` is none of those.
    """

    def __init__(self, normalize: str) -> None:
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
        self.normalize = normalize
        self._items = 0.0                           # counts given as Python numbers
        self._items_t: torch.Tensor | None = None   # counts given as tensors, summed on their device
        self.loss: torch.Tensor | None = None       # the window's summed micro-batch losses (fp64)
        self._mean_scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def count(self, num_items: int | float | torch.Tensor | None, device: torch.device) -> None:
        """Adds a micro-batch's item count (``step(num_items=...)``), checking it fits ``normalize``.

        Raises:
            ValueError: a count missing with ``"items"``, given without it, or not a number >= 0.
        """
        if self.normalize == "items":
            if num_items is None:
                raise ValueError('normalize="items" needs step(num_items=n): the number of items '
                                 "(e.g. tokens) summed in this micro-batch's loss")
            if isinstance(num_items, torch.Tensor):
                n = num_items.detach().to(device=device, dtype=torch.float64)
                self._items_t = n if self._items_t is None else self._items_t + n
            elif isinstance(num_items, bool) or not isinstance(num_items, numbers.Real) or not num_items >= 0:
                raise ValueError(f"num_items must be a number >= 0 or a tensor, got {num_items!r}")
            else:
                self._items += float(num_items)
        elif num_items is not None:
            raise ValueError('num_items is only used with normalize="items"; this optimizer '
                             f"normalizes by {self.normalize!r}")

    def add_loss(self, loss: torch.Tensor | float, device: torch.device) -> None:
        """Adds a micro-batch's loss to the window's, on ``device`` in fp64, without a host sync."""
        loss = torch.as_tensor(loss).detach().to(device=device, dtype=torch.float64)
        self.loss = loss if self.loss is None else self.loss + loss

    def items(self) -> float:
        """The window's item count so far, on the host (a host sync if tensors were counted)."""
        return self._items + (self._items_t.item() if self._items_t is not None else 0.0)

    def add_items_to(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (fp64, on the counts' device) plus the item count so far, without a host sync."""
        t += self._items
        if self._items_t is not None:
            t += self._items_t
        return t

    def set_items(self, items: float) -> None:
        """Replaces the count (with the window's total over all ranks, or a restored one)."""
        self._items, self._items_t = float(items), None

    def scale(self, accum_steps: int, world: int, device: torch.device) -> torch.Tensor:
        """The window's late scale as a 0-d fp32 tensor on ``device``.

        Args:
            accum_steps: micro-batches in the window.
            world: how many ranks' buffers were summed into this one (1 without data parallelism).
        """
        if self.normalize in ("mean", "sum"):
            steps = accum_steps if self.normalize == "mean" else 1
            key = (steps, world)  # accum_steps may be changed between windows
            if self._mean_scale is None or self._mean_scale[0] != key:
                # torch.full, not torch.tensor: no host-to-device copy on CUDA.
                self._mean_scale = key, torch.full((), 1.0 / (steps * world), dtype=torch.float32, device=device)
            return self._mean_scale[1]
        total = torch.full((), self._items, dtype=torch.float64, device=device)
        if self._items_t is not None:
            total = total + self._items_t
        return total.reciprocal().float()

    def reset(self) -> None:
        """Forgets the counts and the loss: a new window begins."""
        self._items, self._items_t = 0.0, None
        self.loss = None


class WindowScheduler:
    """An LR scheduler whose ``step()`` advances only when its FusedAccumOptimizer ended a window.

    Made by :meth:`FusedAccumOptimizer.per_window`. Attributes and methods other than ``step``
    are the wrapped scheduler's; ``scheduler`` is the wrapped one.
    """

    def __init__(self, scheduler: Any, optimizer: Any) -> None:
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
