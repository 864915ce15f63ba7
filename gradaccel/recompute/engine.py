"""Two hooks for an engine that owns the parameters a region reads, such as DeepSpeed ZeRO-3.

ZeRO-3 keeps 1/N of each parameter on each rank: a module's forward pre-hook gathers its
parameters (``param.data`` becomes the whole tensor) and its forward hook releases them
(``param.data`` becomes an empty tensor). A checkpointed region meets that twice:

- its first call is traced op by op, and the engine's gathering runs inside it (an all-gather
  writing a new buffer that becomes the parameter): recorded, it would be replayed in backward
  as part of the region. :func:`outside_regions` marks such work as the engine's own: it runs,
  unrecorded, and the parameters it makes are tensors the region read from outside, as any
  parameter is;
- in backward the replay reads those parameters, which the engine has released by then.
  :func:`around_replay` registers what the engine does around a region's replay: gather what the
  region read from outside, release it after.

gradaccel/recompute/frames.py calls the hooks; gradaccel/integrations/hf_zero3.py installs
ZeRO-3's. Without a registered hook nothing here runs.
"""

import collections
import contextlib
from typing import Callable, ContextManager, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from gradaccel.recompute import split_off

__all__ = ["around_replay", "outside_regions"]

_AROUND = collections.OrderedDict()  # handle id -> hook, in registration order (weakly referable)


def around_replay(hook: Callable[[Sequence[torch.Tensor]], ContextManager]) -> RemovableHandle:
    """Registers ``hook``, entered around the backward replay of every checkpointed region call.

    ``hook(tensors)`` gets the tensors the region's forward read from outside its arguments
    (its parameters, alive), and returns a context manager that makes them readable (gathered)
    on entry and may release them on exit. It is entered once per region call in backward, at
    the first saved tensor backward asks the call for, whether or not that call replays anything
    (its plan may keep all it needs): on every rank at the same point of backward, so that an
    engine whose gathering is a collective calls it on every rank alike. The tensors are the same
    on every rank where the region ran the same code, whatever the sequence length.

    Args:
        hook: ``(tensors) -> context manager``.

    Returns:
        A handle whose ``remove()`` unregisters the hook.
    """
    handle = RemovableHandle(_AROUND)
    _AROUND[handle.id] = hook
    return handle


def active() -> bool:
    """Whether a hook is registered (frames then call :func:`replaying` at a region's first unpack)."""
    return bool(_AROUND)


@contextlib.contextmanager
def replaying(tensors: Sequence[torch.Tensor]):
    """Enters every registered hook with ``tensors``, in registration order."""
    with contextlib.ExitStack() as stack:
        for hook in list(_AROUND.values()):
            stack.enter_context(hook(tensors))
        yield


@contextlib.contextmanager
def outside_regions():
    """What runs inside is an engine's own work, not part of the region being traced (if any):
    its ops are not recorded, and the tensors they make are read by the region as tensors from
    outside (parameters). Outside a trace it does nothing."""
    recorders = [f.recorder for f in split_off.frames() if getattr(f, "recorder", None) is not None]
    paused = [r.paused for r in recorders]
    for r in recorders:
        r.paused = True
    try:
        yield
    finally:
        for r, was in zip(recorders, paused):
            r.paused = was
