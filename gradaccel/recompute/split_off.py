"""Splitting off a data-dependent submodule of a checkpointed region.

A region whose trace ran a data-dependent op (``nonzero``, ``.item()``) cannot be replayed. When
that op ran inside a submodule (eager MoE experts), only that submodule needs the Python forward
again in backward: its ``forward`` becomes one that, inside a gradaccel region, runs as its own
``torch.utils.checkpoint`` and is recorded as one opaque op (gradaccel/recompute/frames.py), so the rest of
the region is traced again and planned. Outside gradaccel regions it runs as before.
"""

import contextlib
import functools

import torch

from gradaccel.recompute.own_forward import own_forward

_ACTIVE: list = []  # the frames of the regions whose forward is running, innermost last


@contextlib.contextmanager
def active(frame):
    _ACTIVE.append(frame)
    try:
        yield
    finally:
        _ACTIVE.pop()


def frames() -> list:
    """The frames of the regions whose forward is running, innermost last."""
    return list(_ACTIVE)


@contextlib.contextmanager
def module_stack(stack: list):
    """Keeps ``stack`` as the modules whose forward is running (the trace only): it tells which
    submodule ran a data-dependent op."""
    def enter(module, args):
        stack.append(module)

    def leave(module, args, out):  # returns None: the output stays as it is
        if stack and stack[-1] is module:
            stack.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def _opaque_forward(module, *args, **kwargs):
    """The ``forward`` of a split-off submodule: inside a gradaccel region, it runs as its own
    ``torch.utils.checkpoint``; anywhere else, as it is."""
    forward = own_forward(module)
    if not _ACTIVE or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return _ACTIVE[-1].opaque(forward, args, kwargs, module._gradaccel_opaque)


def split_off(module: torch.nn.Module, reason: str) -> bool:
    """Makes ``module`` run as its own checkpoint inside gradaccel regions, because of
    ``reason`` (the op). False if it already does."""
    if "_gradaccel_opaque" in module.__dict__:
        return False
    module._gradaccel_opaque = f"{type(module).__name__} as torch.utils.checkpoint ({reason})"
    module.forward = functools.partial(_opaque_forward, module)
    return True
