"""The longest sequence a memory target allows: ``gradaccel.fit.max_seq`` and
``python -m gradaccel.fit --max-seq``.

A step's least peak grows with the sequence (linearly where attention's kernel is O(T) in
memory, faster where it is not), so the longest length that fits is searched on it: doubling
until a length does not fit, then regula falsi on the least peaks of the two ends (rounded to
``granule`` tokens, with bisection where an end stays put), a few fake-tensor profiles in all.
The answer is :func:`gradaccel.memory.fit.fit` at that length: the fastest plan that fits
there, with offload where only a plan with offload fits. Host memory is a limit too
(``host_memory``, gradaccel/memory/parking.py): where it kept the answer shorter than the device
alone would, a second search without it says by how much (``Fit.host_cost``).
"""

import torch

from gradaccel.memory.counter import check_count

__all__ = ["max_seq", "longest"]


def _least_peak(planner, seq: int, batch: int, budget) -> int:
    """The least predicted peak of a step of ``seq`` tokens: micro-batch 1, any plan, with or
    without offload, with the blocks' inputs on the host or not, with the model's loss or in
    chunks (what :meth:`Planner.fit` falls back to), its host bytes within ``budget`` (None: no
    limit)."""
    from gradaccel.memory.fit import _least_either_loss

    inputs = True if budget is None else max(0, budget - planner.static.paged)
    plans = (_least_either_loss(planner, seq, batch, off, host) for off, host in
             ((False, False), (True, False), (False, inputs)))
    return min(r.peak if budget is None or sum(r.host.values()) <= budget else float("inf") for r in plans)


def longest(planner, memory, batch: int = 1, slack=None, granule: int = 1024, limit: int = 1 << 22,
            host_memory=None):
    """See :func:`max_seq`; ``planner``: a :class:`gradaccel.memory.fit.Planner`."""
    from gradaccel.memory.fit import memory_and_slack
    from gradaccel.memory.parking import host_budget

    memory, slack = memory_and_slack(memory, slack)
    budget, _ = host_budget(host_memory)
    planner.host_bound = False
    check_count(batch, "batch"), check_count(granule, "granule"), check_count(limit, "limit")
    usable = memory - slack
    peaks = {}  # length -> least peak

    def peak(t):
        if t not in peaks:
            peaks[t] = _least_peak(planner, t, batch, budget)
        return peaks[t]

    lo, hi = 0, None  # lo fits (0: none known), hi does not
    t = min(8 * granule, limit - limit % granule) or granule
    top = max(granule, limit - limit % granule)
    while hi is None:  # bracket: at least doubling, further where the last two peaks point further
        if peak(t) > usable:
            hi = t
        elif t >= top:
            break
        else:
            nxt = 2 * t
            if lo:  # the line through the last two peaks, a tenth past where it meets the target
                slope = (peaks[t] - peaks[lo]) / (t - lo)
                if slope > 0:
                    nxt = max(nxt, min(16 * t, int(1.1 * (t + (usable - peaks[t]) / slope))))
            lo, t = t, min(-(-nxt // granule) * granule, top)
    last, same = None, 0  # the end that moved last, and how many times in a row
    while hi is not None and hi - lo > granule:
        if lo == 0 or same >= 2:  # bisection where regula falsi keeps moving one end
            t, same = (lo + hi) // 2, 0
        else:  # regula falsi on the least peaks of the two ends
            t = lo + (usable - peaks[lo]) * (hi - lo) / max(1, peaks[hi] - peaks[lo])
        t = min(max(int(t) // granule * granule, lo + granule), hi - granule)
        side = peak(t) <= usable
        same = same + 1 if side == last else 1
        last = side
        if side:
            lo = t
        else:
            hi = t
    # The least peak is an estimate per plan; the fit checks its plan exactly. Step down where
    # the exact check disagrees (a granule at a time; rarely more than once).
    best = planner.fit(max(lo, granule), batch, memory, slack=slack, host_memory=host_memory)
    while not best.fits and lo > granule:
        lo -= granule
        best = planner.fit(lo, batch, memory, slack=slack, host_memory=host_memory)
    best.longer = None if hi is None else (hi, peaks[hi] if hi in peaks else peak(hi))
    # The host budget cost tokens where the next length would fit without it: how many.
    if budget is not None and planner.host_bound and hi is not None and _least_peak(planner, hi, batch, None) <= usable:
        free = longest(planner, memory, batch, slack, granule, limit, host_memory=float("inf"))
        best.host_cost = (free.seq, sum(free.host.values()))
    return best


def max_seq(model, memory, *, batch: int = 1, optim="adamw", lora=None, load_in_4bit=False,
            dtype=torch.bfloat16, master_weights=False, slack=None, granule: int = 1024, limit: int = 1 << 22,
            make_batch=None, loss_fn=None, host_memory=None):
    """The longest sequence that trains in ``memory``, and the plan for it.

    Args:
        model, memory, optim, lora, load_in_4bit, dtype, master_weights, slack, make_batch,
            loss_fn, host_memory: as for :func:`gradaccel.memory.fit.fit`.
        batch: sequences per optimizer step (micro-batches tried as :func:`fit` does).
        granule: the answer is a multiple of this many tokens.
        limit: the longest length tried.

    Returns:
        Fit: :func:`fit`'s answer at the longest multiple of ``granule`` whose predicted peak fits
        (``seq``); ``fits`` False if not even ``granule`` tokens fit. Its ``longer`` is
        ``(length, least predicted peak)`` of the first length found not to fit (None if
        ``limit`` fits). Its ``host_cost`` is ``(longest length, host bytes)`` without the host
        budget where the budget made the answer shorter (None otherwise).
    """
    from gradaccel.memory.fit import Planner

    planner = Planner(model, optim, lora, load_in_4bit, dtype, master_weights, make_batch, loss_fn)
    return longest(planner, memory, batch, slack, granule, limit, host_memory)
