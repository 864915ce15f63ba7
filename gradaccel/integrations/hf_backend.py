"""The engines ``gradaccel.hf.enable`` serves, one object each, and the patches it can undo.

accelerate runs a training script on one of several engines (``accelerator.distributed_type``).
What gradaccel does differs per engine, so each is a :class:`Backend` with the same few methods,
and ``enable`` picks one per accelerator, once (``gradaccel/integrations/hf.py``'s ``pick``):

==================  =====================================  ======================================
engine              backend                                gradient
==================  =====================================  ======================================
one process         :class:`OneProcess` (here)             gradaccel's fp32 window
DDP (``MULTI_*``)   ``hf_dist.DataParallel``               gradaccel's, one all-reduce a window
DeepSpeed ZeRO 0-3  ``hf_deepspeed.DeepSpeed``             DeepSpeed's (checkpointing only);
                                                           ZeRO-3's gathering: ``hf_zero3``
anything else       :class:`Refused`                       ``check`` raises, naming what works
==================  =====================================  ======================================

Every change ``enable`` makes to an object (an accelerator's method, a trainer's, an engine's
hook) goes through :class:`Patches`, so ``gradaccel.hf.disable`` undoes it, as Liger Kernel's
``revert_*`` functions undo its monkey patches.
"""

from __future__ import annotations

from typing import Any, Callable

_ABSENT = object()


class Patches:
    """Attributes set on objects, and callbacks, undone in reverse order by :meth:`undo`."""

    def __init__(self):
        self._undo: list = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``; :meth:`undo` gives back what ``obj`` itself held
        (or removes the attribute, so that its class's shows again)."""
        self._undo.append((obj, name, vars(obj).get(name, _ABSENT)))
        setattr(obj, name, value)

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` at :meth:`undo` (a hook's ``remove``)."""
        self._undo.append((fn, None, None))

    def undo(self) -> None:
        while self._undo:
            obj, name, old = self._undo.pop()
            if name is None:
                obj()
            elif old is _ABSENT:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, old)


class Backend:
    """gradaccel under one engine. ``enable`` calls, in order: :meth:`check` (refuse, naming the
    route), :meth:`say` (what gradaccel takes over there, once), :meth:`install` (the engine's
    own patches), then at each ``accelerator.prepare``: :meth:`prepared` with what it made.
    ``disable`` undoes the patches and calls :meth:`remove`.

    Attributes:
        name: the engine, as messages name it.
        owns_gradient: gradaccel's ``FusedAccumOptimizer`` holds the window's gradient (and so
            clipping and ``backward`` go through it); False where the engine keeps it.
        group: the process group the window buffer is summed over (None: one process).
    """

    name = "one process"
    owns_gradient = True
    group = None

    def __init__(self, acc: Any):
        self.acc = acc

    def check(self, fuse_wgrad: bool) -> None:
        """Raises ValueError for what gradaccel cannot serve on this engine, naming what works."""
        if getattr(self.acc, "scaler", None) is not None and self.owns_gradient:
            raise ValueError("gradaccel.hf.enable: mixed_precision='fp16' uses a gradient scaler that reads .grad, "
                             "which gradaccel frees; use bf16")

    def say(self, budget) -> None:
        """Warns what gradaccel does on this engine, where that needs saying (once per accelerator)."""

    def install(self, patches: Patches) -> None:
        """Patches the engine's own machinery (before ``prepare``)."""

    def prepared(self, objs: list) -> None:
        """Called after ``accelerator.prepare`` with what it returned (an engine it built, say)."""

    def remove(self) -> None:
        """Undoes what :meth:`prepared` installed."""


class OneProcess(Backend):
    """One process: the window's gradient in one fp32 buffer, nothing to sum across ranks."""


class Refused(Backend):
    """An engine gradaccel does not serve: :meth:`check` raises ``message``, which names the route."""

    def __init__(self, acc: Any, name: str, message: str):
        super().__init__(acc)
        self.name, self.message = name, message

    def check(self, fuse_wgrad: bool) -> None:
        raise ValueError(self.message)
