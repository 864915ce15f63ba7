"""What a framework's own accumulation loop asks of ``FusedAccumOptimizer``: its public protocol.

Hugging Face ``Trainer`` and accelerate (through ``gradaccel.hf``) keep their loop: they divide
each micro-batch's loss, run backward, clip once per window (``accelerator.clip_grad_norm_``,
which reads ``.grad``) and call ``step()`` once per window. The optimizer then runs with
``accum_steps=1, normalize="sum"`` and the framework tells it, through these methods, what its
own loop did: that a backward ran (the ranks check at the window's end that they ran as many),
which loss it differentiated, where to clip, which rank stopped. Mixed into
:class:`gradaccel.accumulate.optimizer.FusedAccumOptimizer`.
"""

from __future__ import annotations

from typing import Any

import torch


class FrameworkLoop:
    """The methods a framework's loop calls (see the module docstring)."""

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` group the window buffer is summed over (the process group
        given, or FSDP2's mesh group), or None on one process."""
        return self._sync.process_group()

    @property
    def folded_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients fold into the window buffer, in its order: the
        model's own, also where ``master_weights`` puts fp32 masters in ``param_groups``."""
        return list(self._slots.params)

    def note_backward(self, loss: torch.Tensor | float | None = None) -> None:
        """Tells the optimizer that the framework ran one micro-batch's backward.

        Args:
            loss: the loss that backward differentiated (already divided as the framework divides
                it), or None; summed without a host sync into ``window_loss``.
        """
        if not self._sync.sharded:  # FSDP2's window counts its own reduce-scatters
            self._sync.count_backward()  # the ranks check at the window's end that they ran as many
        if loss is not None:
            self._add_loss(loss)

    def abort(self, exc: BaseException) -> None:
        """Tells the other ranks that this one stopped mid-window: they raise at once instead of
        waiting for it at the window's end. A no-op on one process.

        Args:
            exc: what stopped this rank (named in the other ranks' error).
        """
        agreement = getattr(self._sync, "agreement", None)
        if agreement is not None:
            agreement.abort(exc)

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
            self._clip(norm, float(max_norm))
        return torch.tensor(norm if finite else float("nan"), dtype=torch.float32)

    def release(self) -> torch.optim.Optimizer:
        """Removes the fold hooks (and ``fuse_wgrad``'s routes) and returns the wrapped optimizer,
        for a framework that takes its optimizer back (``gradaccel.hf.disable``). This wrapper is
        unusable afterwards.

        Returns:
            The wrapped optimizer, its ``param_groups`` and ``state`` as they are.

        Raises:
            RuntimeError: mid-window (gradients folded but not applied), or with
                ``master_weights`` (the wrapped optimizer holds the fp32 masters, not the model's
                parameters).
        """
        if self._micro or self._pending is not None:
            raise RuntimeError("FusedAccumOptimizer.release() mid-window would drop the gradients folded since "
                               "the last update; call it between windows (or reset_window() first)")
        if self.master_weights:
            raise RuntimeError("FusedAccumOptimizer.release() with master_weights=True: the wrapped optimizer "
                               "updates the fp32 masters, not the model's parameters")
        self._slots.remove_hooks()
        self._unroute()
        return self.optimizer
