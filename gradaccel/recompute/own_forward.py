"""A module's own ``forward``, bound to it, past what wraps it (checkpoint_blocks' subclass, the
forwards that parts, sliced plans and split-off submodules give a module's instance)."""

import functools

import torch


def own_forward(module: torch.nn.Module, cls: type = None):
    """``cls.forward`` (``type(module)``'s by default) bound to ``module``.

    Eagerly it is a bound method: gradaccel.checkpoint keys a region's plan on its ``__self__``,
    names the region and reads the module's state from it. While dynamo traces, it is
    ``functools.partial(forward, module)``, which compiled.owner_of keys the same way (the
    module and the function): torch 2.11's dynamo cannot trace ``function.__get__`` (a graph
    break at every call; 2.13's can), and neither torch's traces ``types.MethodType``. (Not
    ``is_compiling()``: torch 2.13 holds that True for the whole compile session, also in the
    Python that plans a region on fake tensors, which runs eagerly.)
    """
    forward = (cls or type(module)).forward
    if torch.compiler.is_dynamo_compiling():
        return functools.partial(forward, module)
    return forward.__get__(module)
