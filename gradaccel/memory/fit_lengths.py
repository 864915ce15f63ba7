"""``Fit.apply``'s plans at other sequence lengths than the fitted one: each training call gets
the plan of its own length, for the fit's target, from the length profile (gradaccel/memory/lengths.py).

Why per length and not the fitted length's budgets: a budget is bytes, and at a shorter length
a block's activations are fewer, so the fitted budget would keep nearly everything: it may fit,
but it is not the least-recompute plan there, and at a longer length it would not fit at all.
Re-planning is the knapsack (gradaccel/memory/split.py) on the predicted profile: milliseconds.
"""

import copy
import threading
import warnings

import torch
from torch.utils._pytree import tree_flatten

from gradaccel.memory.split import least_peak, least_recompute, uncheckpointed
from gradaccel.memory.lengths import length_of
from gradaccel.memory.target import set_plans

__all__ = ["FittedLengths"]

_busy = threading.local()
KEPT = 1024  # lengths whose plan is kept; past it, the oldest goes


class FittedLengths:
    """A forward pre-hook: sets each block's plan for the call's sequence length.

    Attributes:
        plans: length -> per-block settings (``Fit.budgets``' form).
        profiled: lengths that needed a fake-tensor run (past the fitted ``seq``, or not
            predictable: see ``LengthProfile.failed``).
    """

    def __init__(self, fit, planner, blocks):
        self.fit, self.planner, self.blocks = fit, planner, blocks
        self.plans = {fit.seq: list(fit.budgets)}
        self.profiled = []

    def __deepcopy__(self, memo):
        # A copy of the model shares the fit and its planner (its profiles hold fake copies of
        # the model, which the profiler would otherwise copy on every run) and keeps its plans.
        new = copy.copy(self)
        new.plans, new.profiled = dict(self.plans), list(self.profiled)
        return new

    def __call__(self, module, args, kwargs):
        if getattr(_busy, "on", False) or not (module.training and torch.is_grad_enabled()):
            return None
        flat = tree_flatten((args, kwargs))[0]
        length, _ = length_of(flat)
        first = next((t for t in flat if isinstance(t, torch.Tensor)), None)
        if length is None or first is None or first.shape[0] != self.fit.micro_batch:
            settings = self.fit.budgets  # another micro-batch: the fitted plan, as before
        else:
            settings = self.plans.get(length)
            if settings is None:
                _busy.on = True
                try:
                    settings = self.plans[length] = self._plan(length)
                finally:
                    _busy.on = False
                while len(self.plans) > KEPT:
                    self.plans.pop(next(iter(self.plans)))
        set_plans(module, self.blocks, self.fit.chunked_loss, settings)
        return None

    def _plan(self, length: int) -> list:
        fit, planner = self.fit, self.planner
        lp = planner.lengths(fit.seq, fit.micro_batch, fit.chunked_loss)
        if lp.failed is None and not lp.covers(length):
            if length > fit.seq:
                warnings.warn(f"gradaccel.fit: a step of length {length} is longer than the fit's seq={fit.seq}: it is "
                              "profiled on fake tensors once and planned for the same target", UserWarning,
                              stacklevel=4)
            lp.extend(length)
            self.profiled.append(length)
        if lp.covers(length):
            prof = lp.at(length)
        else:
            prof = planner.profile(length, fit.micro_batch, fit.chunked_loss)
            self.profiled.append(length)
        room = fit.memory - fit.slack - planner.static.total - planner._dequantised(prof)
        bare = uncheckpointed(prof, room, planner.layout) if room > 0 else None
        if bare is not None:
            return [None] * len(bare)  # every block fits uncheckpointed: nothing to recompute
        fronts = planner.fronts(prof)
        points = least_recompute(prof, fronts, room, layout=planner.layout) if room > 0 else None
        if points is None and hasattr(prof, "_source") and room > 0:
            # The predicted profile offers the candidate plans fitted across lengths, fewer than a
            # profile of this length. The plan of the next profiled length holds here too (the
            # same ops on tensors no larger): where it fits there, it is the plan, with no run.
            above = min((t for t in lp.profiles if t > length), default=None)
            if above is not None:
                top = lp.at(above)
                kept = least_recompute(top, planner.fronts(top), room, layout=planner.layout)
                if kept is not None:
                    return [p.budget for p in kept]
            # Else, before going over the target, profile this length itself (once).
            prof = planner.profile(length, fit.micro_batch, fit.chunked_loss)
            self.profiled.append(length)
            fronts = planner.fronts(prof)
            points = least_recompute(prof, fronts, room, layout=planner.layout)
        if points is None:
            points = least_peak(prof, fronts, planner.layout)
            least = planner.predict(prof, points)["peak"] + planner.static.total + fit.slack
            warnings.warn(f"gradaccel.fit: at length {length} no plan fits the target of {fit.memory} bytes; the "
                          f"least-peak plan is used ({least} bytes predicted, slack included; short by "
                          f"{least - fit.memory} bytes)", UserWarning, stacklevel=4)
        return [p.budget for p in points]
