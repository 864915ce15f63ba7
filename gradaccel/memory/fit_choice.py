"""Which of the plans that fit the fit returns, and why that one and not the next.

Plans are priced in the planner's units (FLOPs, plus bytes moved at the machine balance; see
gradaccel/recompute/cost.py): the same inputs give the same prices on an idle and on a loaded
machine. Two things are measured instead, once per process: the speed of copies to host memory
(offload, inputs on the host: ``Fit.measured_cost`` is the part of a plan's price they make), and
the time of ops outside aten on a real trace (never in a fit: it profiles fake tensors). A load
can move a measured speed by half, so a difference in price within ``NOISE`` of the measured
parts decides nothing: of such plans the one with the lower peak is taken, which no load moves.

The rule between two plans (:func:`prefer`): least predicted time per optimizer step, unless

- the two are within ``NOISE`` of their measured parts: the lower predicted peak;
- the two are within ``BAND`` of each other: the larger micro-batch (fewer, larger kernels,
  which the cost model does not see).

:func:`choose` applies it over the candidates and writes the reason it won over the runner-up
into ``why``.
"""

from gradaccel.memory.counter import format_bytes

__all__ = ["NOISE", "BAND", "prefer", "choose", "faster_option"]

NOISE = 0.5  # how far a measured copy speed may move on a loaded machine (a fraction of it)
BAND = 0.005  # predicted times this close are a tie the larger micro-batch takes


def prefer(a, b) -> tuple:
    """``(winner, reason)`` between plans ``a`` and ``b`` (``Fit``s): see the module docstring."""
    cheap, dear = (a, b) if a.step_cost <= b.step_cost else (b, a)
    gap = dear.step_cost - cheap.step_cost
    noise = NOISE * (a.measured_cost + b.measured_cost)
    if gap <= noise and a.peak != b.peak:
        low = min(a, b, key=lambda r: r.peak)
        return low, (f"predicted times within what the measured copy speed may vary by ({gap / dear.step_cost:.1%} "
                     f"apart): the lower peak ({format_bytes(low.peak)} against {format_bytes(max(a.peak, b.peak))})")
    if gap <= BAND * dear.step_cost and a.micro_batch != b.micro_batch:
        big = max(a, b, key=lambda r: r.micro_batch)
        return big, (f"predicted times within {BAND:.1%} ({gap / dear.step_cost:.2%} apart): the larger "
                     "micro-batch (fewer, larger kernels)")
    if gap == 0:
        return cheap, "the same predicted time"
    return cheap, f"{gap / dear.step_cost:.1%} less predicted time per optimizer step"


def _best(candidates: list):
    best = None
    for c in sorted(candidates, key=lambda r: (r.step_cost, r.peak, -r.micro_batch)):
        best = c if best is None else prefer(best, c)[0]
    return best


def choose(candidates: list):
    """The plan :func:`prefer` picks among ``candidates`` (``Fit``s, at least one), with ``why``
    set: what it was chosen over, and the reason."""
    best = _best(candidates)
    rest = [c for c in candidates if c is not best]
    if rest:
        runner = _best(rest)
        best.why = f"chosen over {runner.summary()}: {prefer(best, runner)[1]}"
    else:
        best.why = "the only plan that fits"
    return best


def faster_option(option, best) -> bool:
    """Whether ``option`` (a plan that holds host memory) is faster than ``best`` beyond what the
    measured copy speed and the tie band leave undecided: only then is it worth listing."""
    return option.step_cost + NOISE * (option.measured_cost + best.measured_cost) < best.step_cost * (1 - BAND)
