"""FusedAccumOptimizer on FSDP2 (``fully_shard``) models: DTensor parameters, sharded windows.

Each parameter of a ``fully_shard``-ed model is a DTensor whose local tensor is this rank's dim-0
shard. FSDP2 reduce-scatters the gradient (averaged over ranks) and then calls the sharded
parameter's post-accumulate-grad hooks, so the fold hook of ``_slots.py`` sees a sharded DTensor
gradient: its local tensor goes into this rank's slice of the flat fp32 buffer, which therefore
holds 4 bytes per parameter divided by the world size.

Two ways to sync a window (``sync=``):

- ``"micro_batch"``: FSDP2's default; a reduce-scatter after every micro-batch's backward, folded
  at once. Least memory: no unsharded gradient outlives its module's backward.
- ``"window"``: FSDP2 keeps the unsharded gradients for the window
  (``set_requires_gradient_sync(False)``, accumulated in the reduce dtype, which must be fp32) and
  reduce-scatters once, on the window's last micro-batch. Least communication; every rank holds
  the full model's gradients in fp32 until then.

At the end of a window the ranks agree, in one small all-gather on a CPU (gloo) group with a
timeout, on the micro-step, ``accum_steps``, the item count and which parameters got gradients;
a rank that diverged is reported by name instead of hanging. A second small all-reduce makes the
norm and the non-finite flag global, so that every rank clips alike and skips or steps together.
"""

from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SYNC", "ShardedWindow", "WindowDropped", "as_grad", "check_params", "local"]

SYNC = ("micro_batch", "window")
# Which sync="window" optimizer turns each module's gradient sync on and off (a token of it): one
# that goes restores FSDP2's default only if no newer one took the module over.
_WINDOW_OWNER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# How long a rank waits at the end of a window for the others before it reports divergence.
CHECK_TIMEOUT_S = 120.0

try:  # torch.distributed may be built without DTensor (some mobile/Windows builds)
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    DTensor = Shard = None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor (a view, writes go through), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def as_grad(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``g`` (this rank's shard) as a gradient for ``like``: a DTensor with ``like``'s sharding."""
    if not is_dtensor(like):
        return g
    return DTensor.from_local(g, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def check_params(params: list[torch.Tensor], process_group: Any) -> bool:
    """Refuses what FusedAccumOptimizer cannot accumulate; returns whether ``params`` are sharded.

    Raises:
        TypeError: FSDP1 flat parameters; DTensor parameters on a mesh FSDP2 does not build
            (not 1-D, or not sharded on dim 0).
        ValueError: ``process_group=`` with DTensor parameters; DTensor and plain parameters mixed.
    """
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # pragma: no cover
        FlatParameter = ()
    # FSDP1 marks the parameters it flattened (use_orig_params=True leaves those in the model).
    if any(isinstance(p, FlatParameter) or getattr(p, "_fsdp_flattened", False) for p in params):
        raise TypeError("FusedAccumOptimizer does not support FullyShardedDataParallel (FSDP1) flat "
                        "parameters; shard the model with FSDP2, torch.distributed.fsdp.fully_shard, "
                        "and build the optimizer on model.parameters()")
    trainable = [p for p in params if p.requires_grad]
    sharded = [is_dtensor(p) for p in trainable]
    if not any(sharded):
        return False
    if not all(sharded):
        raise ValueError("some parameters are DTensors (fully_shard) and some are plain tensors; "
                         "apply fully_shard to the root module too, so that every parameter is sharded")
    if process_group is not None:
        raise ValueError("process_group is for a replicated plain model; these parameters are "
                         "DTensors (fully_shard), whose gradients FSDP2 reduce-scatters itself. Drop "
                         "process_group= (choose how often FSDP2 syncs with sync='micro_batch' or 'window')")
    mesh = trainable[0].device_mesh
    for p in trainable:
        if p.device_mesh != mesh or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise TypeError("FusedAccumOptimizer supports DTensor parameters sharded on dim 0 over one "
                            f"1-D mesh, as fully_shard makes them; got {p.placements} on {p.device_mesh}")
    return True


def _fsdp_params(module: torch.nn.Module) -> list:
    """FSDP2's per-parameter records under ``module`` (private API: the only place its unsharded
    gradients and dtype policy live)."""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            # torch 2.13 keeps a list of groups per module; 2.11 one group, or None.
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                one = getattr(state, "_fsdp_param_group", None)
                groups = [one] if one is not None else []
            out.extend((group, fp) for group in groups for fp in group.fsdp_params)
    return out


def _held_dtypes(module: torch.nn.Module) -> set:
    """The dtypes FSDP2 accumulates unsharded gradients in without gradient sync: the policy's
    reduce dtype, else its param dtype, else the parameter's."""
    return {group.mp_policy.reduce_dtype or group.mp_policy.param_dtype or fp.sharded_param.dtype
            for group, fp in _fsdp_params(module)}


class WindowDropped(RuntimeError):
    """A window lost on every rank alike: the ranks are still in step and may go on."""


class ShardedWindow:
    """The distributed half of a window over DTensor parameters (see the module docstring).

    Args:
        params: the adopted (trainable) DTensor parameters.
        sync: ``"micro_batch"`` or ``"window"``.
        module: the ``fully_shard``-ed root module; required with ``sync="window"``.
    """

    sharded = True

    def __init__(self, params: list[torch.Tensor], sync: str, module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule
        if sync not in SYNC:
            raise ValueError(f"sync must be one of {SYNC}, got {sync!r}")
        if sync == "window":
            if not isinstance(module, FSDPModule):
                raise ValueError("sync='window' needs module=<the fully_shard-ed root module>: the "
                                 "optimizer turns its gradient sync off until the window's last "
                                 "micro-batch (FSDPModule.set_requires_gradient_sync)")
            for held in _held_dtypes(module) - {torch.float32}:
                raise ValueError("sync='window' holds the unsharded gradients in FSDP2's reduce dtype, "
                                 f"here {held}: pass fully_shard(..., mp_policy=MixedPrecisionPolicy("
                                 "param_dtype=..., reduce_dtype=torch.float32)) for exact accumulation, "
                                 "or use sync='micro_batch'")
        elif module is not None and not isinstance(module, FSDPModule):
            raise TypeError(f"module must be a fully_shard-ed module, got {type(module).__name__}")
        self.sync = sync
        self._module = None if module is None else weakref.ref(module)
        self.cover(params)
        self._token = object()
        if sync == "window":
            _WINDOW_OWNER[module] = self._token
        mesh = params[0].device_mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        # A gloo side group with a timeout for the end-of-window agreement: a rank that diverged
        # is waiting in one of FSDP2's collectives, and this wait must end with an error.
        ranks = dist.get_process_group_ranks(self.group)
        side = dist.new_group(ranks, backend="gloo",
                              timeout=datetime.timedelta(seconds=CHECK_TIMEOUT_S))
        self._side = weakref.ref(side)  # weakly, as FusedAccumOptimizer holds its process_group

    def cover(self, params: list[torch.Tensor]) -> None:
        """With ``sync="window"``, refuses parameters that ``module`` does not shard: their FSDP
        module would still reduce-scatter every micro-batch, into the released buffer."""
        if self.sync != "window":
            return
        module = self._module()
        mine = {id(fp.sharded_param) for _, fp in _fsdp_params(module)} if module is not None else set()
        if any(id(p) not in mine for p in params):
            raise ValueError("sync='window': module= must be the fully_shard-ed root module that holds "
                             "every parameter of the optimizer (its gradient sync is turned off for "
                             "the window); some parameters belong to no FSDP module under it")

    # --- FSDP2's gradient sync -----------------------------------------------------------------
    def before_micro_batch(self, micro: int, accum_steps: int, flat: torch.Tensor) -> None:
        """With ``sync="window"``, FSDP2 reduce-scatters only in the window's last backward, and
        only that backward writes the buffer: until then its memory is released, so that a rank
        holds FSDP2's unsharded gradients or the buffer at a micro-batch boundary, not both."""
        if self.sync == "window":
            last = micro >= accum_steps - 1
            if last:
                # The next backward reduce-scatters on the main group, with no timeout of ours: a
                # rank that would not (another accum_steps) must be caught before it, not hang.
                self._gather_steps(micro, accum_steps, "is about to run a window's last micro-batch", [])
            module = self._module()
            if module is not None:
                module.set_requires_gradient_sync(last)
            self.hold(flat, last)

    @staticmethod
    def hold(flat: torch.Tensor, needed: bool) -> None:
        """Gives the buffer its memory back (its content is then undefined) or releases it. The
        slices stay valid views: resizing a storage keeps the tensors that view it."""
        storage = flat.untyped_storage()
        if needed and storage.nbytes() < flat.numel() * flat.element_size():
            storage.resize_(flat.numel() * flat.element_size())
        elif not needed and storage.nbytes():
            storage.resize_(0)

    def __del__(self) -> None:
        # The module outlives this optimizer: give it back FSDP2's default, a reduce-scatter every
        # backward, so that a later optimizer (or a stock loop) gets its gradients.
        try:
            module = self._module() if self._module is not None else None
            if self.sync == "window" and module is not None and _WINDOW_OWNER.get(module) is self._token:
                self.discard()
                module.set_requires_gradient_sync(True)
        except Exception:  # interpreter shutdown: nothing left to restore
            pass

    def holds_unreduced(self) -> bool:
        """Whether FSDP2 still holds unsharded gradients that no reduce-scatter has taken
        (``sync="window"``: the window's last micro-batch had no backward, or missed a module)."""
        module = self._module() if self._module is not None else None
        if self.sync != "window" or module is None:
            return False
        return any(fp.unsharded_accumulated_grad is not None
                   or getattr(getattr(fp, "_unsharded_param", None), "grad", None) is not None
                   for _, fp in _fsdp_params(module))

    def discard(self) -> None:
        """Drops the unsharded gradients FSDP2 holds for the window (``sync="window"``)."""
        module = self._module() if self._module is not None else None
        if self.sync != "window" or module is None:
            return
        for _, fp in _fsdp_params(module):
            fp.unsharded_accumulated_grad = None
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    # --- the end of a window -------------------------------------------------------------------
    def process_group(self) -> None:
        """None: FSDP2 reduces over its own mesh (``process_group=`` is refused with DTensors)."""
        return None

    def reduce(self, flat: torch.Tensor, micro: int, accum_steps: int, norm: Any,
               touched: list[bool]) -> tuple[int, list[bool]]:
        """The window's end, as ``ReplicatedSync.reduce`` (``gradaccel/accumulate/sync.py``): FSDP2 has
        reduce-scattered the buffer already, so only the counts and flags are agreed on.

        Returns:
            (1: FSDP2 already averaged over ranks, so the scale is 1/accum_steps or world/total
            items; touched on any rank). ``norm`` gets the total items divided by the world.
        """
        items, touched = self.agree(micro, accum_steps, norm.items(), touched)
        norm.set_items(items)
        return 1, touched

    def combine(self, host: list[float]) -> list[float]:
        """The window's (sum of squares, non-finite flag, loss...) summed over all shards: every
        rank clips alike, skips alike and logs the same loss."""
        host = self.global_sums(host)
        if len(host) > 2:  # each rank's loss was scaled as FSDP2's rank-averaged gradient is
            host[2] /= self.world
        return host

    def agree(self, micro: int, accum_steps: int, items: float, touched: list[bool]) -> tuple[float, list[bool]]:
        """All ranks' micro-step, accum_steps, items and touched flags; raises on divergence.

        Returns:
            (the window's item count over all ranks divided by the world size, touched on any rank).
            FSDP2's reduce-scatter already averaged over ranks, so items/world is what a
            per-rank sum must be divided by.

        Raises:
            WindowDropped: on every rank, when one still held unreduced gradients (see
                :meth:`holds_unreduced`); they are discarded, and the caller starts a new window.
        """
        held = self.holds_unreduced()
        table = self._gather_steps(micro, accum_steps, "ended a window",
                                   [items, float(held)] + [float(t) for t in touched])
        if table[:, 4].any():
            self.discard()  # on every rank: the next window starts clean
            raise WindowDropped("FusedAccumOptimizer: sync='window' reduce-scatters in the backward of the "
                               "window's last micro-batch, and this window's last step() came with no "
                               "backward (or one that missed an FSDP module) on some rank: the earlier "
                               "micro-batches' gradients were never reduced. The window is dropped. Run a "
                               "backward on every micro-batch (a zero loss where a rank has no data) or "
                               "use sync='micro_batch'")
        return table[:, 3].sum().item() / self.world, (table[:, 5:].amax(0) > 0).tolist()

    def _gather_steps(self, micro: int, accum_steps: int, where: str, extra: list[float]) -> torch.Tensor:
        """Every rank's row (rank, micro, accum_steps, *extra) from the side group; raises when a
        rank does not come within the timeout or the ranks' (micro, accum_steps) differ."""
        mine = torch.tensor([float(dist.get_rank()), float(micro), float(accum_steps)] + extra,
                            dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(rows, mine, group=self._side_group())
        except RuntimeError as e:
            raise RuntimeError(
                f"FusedAccumOptimizer: rank {dist.get_rank()} {where} (micro-batch {micro} of "
                f"{accum_steps}) but the other ranks did not within {CHECK_TIMEOUT_S:.0f} s. Every rank "
                "must call step() once per micro-batch with the same accum_steps "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        table = torch.stack(rows)
        steps = {int(r[0]): (int(r[1]), int(r[2])) for r in table}
        if len(set(steps.values())) != 1:
            raise RuntimeError("FusedAccumOptimizer: the ranks diverged: (micro-step, accum_steps) per rank "
                               f"= {steps}. Every rank must call step() once per micro-batch with the same "
                               "accum_steps")
        return table

    def global_sums(self, values: list[float]) -> list[float]:
        """``values`` (sum of squares, non-finite flag, ...) summed over all ranks, in one small
        all-reduce; every rank gets the same."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self._side_group())
        return t.tolist()

    def _side_group(self):
        side = self._side()
        if side is None:
            raise RuntimeError("FusedAccumOptimizer: its process group was destroyed; build a new optimizer")
        return side
