"""A step's peak composed from a profile's measurements: the part of :class:`~gradaccel.memory.profile.Profile` that predicts.

gradaccel/memory/profile.py measures (the skeleton pass's phases, each block kind's standalone
peaks and plans); :class:`StepPeak`, which ``Profile`` inherits, turns those into the peak of a
micro-step under any per-block plans: the terms of the peak that do not depend on the plans
(:meth:`StepPeak.step_terms`), a block's own two peaks under a plan (:meth:`StepPeak.need`),
their composition (:meth:`StepPeak.predict`), the recompute they cost (:meth:`StepPeak.recompute`),
and, with the blocks' inputs on the host (gradaccel/memory/parking.py), what parking holds and
what its copies cost (:meth:`StepPeak.parked_bytes`, :meth:`StepPeak.copy_exposed`).
"""

import dataclasses

from gradaccel.memory.kinds import Kind
from gradaccel.memory.parking import DEVICE, HOST, PAIR, PAIRED, PARKED
from gradaccel.memory.parts import is_parts, is_sliced, slices_of
from gradaccel.recompute.plan import copy_device, offload_cost_per_byte


class StepPeak:
    """The step's peak from the measurements of a :class:`~gradaccel.memory.profile.Profile`
    (its ``phases``, ``pre``, ``held``, ``blocks``, ``kind_of`` and block runs)."""

    # Block inputs parked on the host (checkpoint_blocks(inputs_on_host=True)): step_terms prices
    # them. A class default: profiles predicted at other lengths are made without __init__.
    inputs_on_host = False

    def step_terms(self, layout: list | None = None) -> dict:
        """The step's peak as terms that do not depend on the plans, for :meth:`predict` and
        :func:`gradaccel.memory.split.least_recompute`.

        With block ``i`` under plan ``p_i`` and ``D_i`` the bytes the blocks before ``i`` keep
        beyond their keep-nothing plans, the peak is the largest of ``fixed``, ``D_i +``
        :meth:`need` of each block, and ``D_n + head``. Each entry is ``(bytes, phase, bytes the
        blocks hold, bytes live at the phase's start)`` at keep-nothing plans.
        """
        layout = list(range(len(self.blocks))) if layout is None else list(layout)
        key = (tuple(layout), self.inputs_on_host if isinstance(self.inputs_on_host, bool) else tuple(self.inputs_on_host))
        if key in self._terms:
            return self._terms[key]
        ph, pre, held = self.phases, self.pre, self.held
        # Inputs on the host: block i's input leaves the device when its forward ends (its private
        # copy made for the forward is live during it) and comes back when its backward starts,
        # with the input parked before it prefetched: ``away`` bytes of inputs are off the device.
        # A pair (gradaccel/memory/parking.py) parks its first block's input when the second's
        # forward ends, and the second's input is not held: both are back in the second's backward.
        away, last, pending = 0, 0, None  # last: the input parked last; pending: (bytes, last) of a pair's first
        fixed = [(ph["pre"][1], "pre", 0, ph["pre"][0])]
        if "tail" in ph:
            fixed.append((ph["tail"][1], "tail", 0, ph["tail"][0]))
        H, blocks, fwd, bwd = pre[0], 0, [], []
        for i, (s, role) in enumerate(zip(layout, self.roles(len(layout)))):
            H += pre[s] - (held[s - 1] if s > 0 else pre[0])
            mine = self.parked_bytes(s) if role in PARKED else 0
            copy = mine + (pending[0] if role == PAIRED else 0)  # private copies on the device in this forward
            fwd.append((H - away + ph[("fwd", s)][1] - pre[s] + copy, ("fwd", i), blocks - away, H - away))
            H += held[s] - pre[s]
            blocks += held[s] - pre[s]
            start, peak = ph[("bwd", s)]
            prev = 0 if role == DEVICE else (pending[1] if role == PAIRED else last)  # prefetched meanwhile
            bwd.append((H - away + prev + peak - held[s], ("bwd", i), blocks - away + prev,
                        H - away + prev + start - held[s]))
            if role == PAIR:
                pending = (mine, last)
            elif role == PAIRED:
                away, last, pending = away + pending[0] + self.parked_bytes(s), pending[0], None
            elif role == HOST:
                away, last = away + mine, mine
        last = len(self.blocks) - 1
        head = (H - away + ph["head"][1] - held[last], "head", blocks - away, H - away + ph["head"][0] - held[last])
        self._terms[key] = {"layout": layout, "fixed": max(fixed, key=_first), "fwd": fwd, "bwd": bwd, "head": head}
        return self._terms[key]

    def parked_bytes(self, s: int) -> int:
        """Bytes of profiled block ``s``'s input that ``inputs_on_host`` parks on the host
        (gradaccel/recompute/host_inputs.py: its first argument, the hidden state)."""
        from gradaccel.recompute.host_inputs import parked_bytes

        args = self.kind_of[s].args
        return parked_bytes(args[0]) if args and s not in self.pinned_inputs else 0

    def roles(self, n: int) -> tuple:
        """Each of ``n`` blocks' role (gradaccel/memory/parking.py) under ``inputs_on_host``: True,
        every block parked; False, none; or the roles themselves."""
        if isinstance(self.inputs_on_host, bool):
            return ((HOST if self.inputs_on_host else DEVICE),) * n
        return tuple(self.inputs_on_host)

    def host_options(self, kind: Kind, offload: bool = False, role: str = HOST) -> list:
        """:meth:`options` for a block whose role is ``role`` (gradaccel/memory/parking.py). Parked
        (``HOST``): a block run as its parts keeps its input on the device (it is not one
        checkpoint), so its kept bytes grow by it. In a pair: sliced plans only, each recomputing
        one forward of the block more (the pair's checkpoint runs it again in backward)."""
        if role in (PAIR, PAIRED):
            return [dataclasses.replace(p, cost=p.cost + kind.forward_cost, flops=p.flops + kind.zero.flops)
                    for p in self.options(kind, offload) if is_sliced(p.plan)]
        if role == DEVICE:
            return self.options(kind, offload)
        inp = self.parked_bytes(kind.blocks[0])
        return [dataclasses.replace(p, kept=p.kept + inp) if is_parts(p.plan) else p
                for p in self.options(kind, offload)]

    def copy_exposed(self, layout: list | None = None) -> float:
        """With the inputs on the host, the copies' time not hidden behind the blocks' compute, in
        the planner's cost units, per micro-step: per block, the copy out against its forward,
        the copy back against its backward (twice the forward), at the copy speed measured at
        start (``offload_cost_per_byte``: a round trip, taken as half each way)."""
        layout = list(range(len(self.blocks))) if layout is None else list(layout)
        total = 0.0
        for s, role in zip(layout, self.roles(len(layout))):
            if role not in PARKED:
                continue
            kind = self.kind_of[s]
            one_way = offload_cost_per_byte(copy_device(kind.graph), kind.graph.cost) * self.parked_bytes(s) / 2
            total += max(0.0, one_way - kind.forward_cost) + max(0.0, one_way - 2 * kind.forward_cost)
        return total

    def need(self, terms: dict, i: int, point, exact: bool = True) -> tuple:
        """Block ``i``'s two peaks under ``point`` (its forward, its backward), in bytes above
        what the blocks before it keep beyond keep-nothing: a plan that keeps ``K`` bytes more
        than keep-nothing changes its forward and backward by the difference of its standalone
        peaks (:meth:`block_peak`; when ``exact`` is False, without running blocks:
        :meth:`block_peak_estimate`, and ``K`` for the forward, which is never less), and adds
        ``K`` to everything after its forward until its backward (its own backward included)."""
        kind = self.kind_of[terms["layout"][i]]
        dk = point.kept - kind.zero.kept
        if exact or slices_of(point.plan) > 0:  # parts plans are run anyway; their forward holds less
            grow = self.block_forward_peak(kind, point) - self.block_forward_peak(kind, kind.zero)
        else:
            grow = dk
        peak_of = self.block_peak if exact else self.block_peak_estimate
        # Offload: the block's own fetched tensors are in its standalone run (a store that keeps
        # host copies off the device). The prefetch of the next block's tensors that
        # OffloadFrame.unpack starts is not added: measured on CPU, the step's peak matched
        # without it (tests/memory/test_fit.py); not yet checked against a GPU.
        mine = (peak_of(kind, point) - point.kept) - (peak_of(kind, kind.zero) - kind.zero.kept)
        return terms["fwd"][i][0] + grow, terms["bwd"][i][0] + dk + mine

    def predict(self, points: list, exact: bool = True, layout: list | None = None) -> dict:
        """Peak live bytes of the micro-step (above what existed before it: weights, buffer,
        optimizer state) with block ``i`` under ``points[i]``, and what makes it up.

        From the skeleton (every block at the keep-nothing plan) each phase's start and peak;
        each block's plan changes them as :meth:`need` says. ``layout[i]`` is the profiled
        block that block ``i`` repeats, for a model profiled with fewer blocks than it has (the
        default: block ``i`` is profiled block ``i``).

        Returns:
            dict: ``peak`` and where it is (``phase``); what is live when that phase starts:
            ``blocks`` (bytes the blocks hold), ``outside`` (other activations and gradients);
            ``transient`` (the rest: the phase's own working set).
        """
        terms = self.step_terms(layout)
        best, D = terms["fixed"], 0  # D: bytes the blocks so far keep beyond keep-nothing
        for i, p in enumerate(points):
            dk = p.kept - self.kind_of[terms["layout"][i]].zero.kept
            fwd, bwd = self.need(terms, i, p, exact)
            # In its backward, a block's own extra kept bytes are live at the phase's start.
            for value, (_, phase, blocks, start), held in ((fwd, terms["fwd"][i], D), (bwd, terms["bwd"][i], D + dk)):
                best = max(best, (value + D, phase, blocks + held, start + held), key=_first)
            D += dk
        value, phase, blocks, start = terms["head"]
        best = max(best, (value + D, phase, blocks + D, start + D), key=_first)
        value, phase, blocks, start = best
        return {"peak": value, "phase": phase, "blocks": blocks, "outside": max(0, start - blocks),
                "transient": max(0, value - max(start, blocks))}

    def recompute(self, points: list) -> tuple:
        """(recompute cost, forward cost of the blocks) of one micro-step under ``points``, in the
        planner's units (FLOPs plus bytes moved at the machine balance)."""
        rc = sum(p.cost for p in points)
        fc = sum(self.kind_of[i].forward_cost for i in range(len(points)))
        return rc, fc


def _first(x):
    return x[0]
