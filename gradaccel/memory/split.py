"""One memory target split across blocks: the per-block plans with the least total recompute
whose predicted step peak fits.

What a block keeps is not a cost paid once against a total: it is live from the block's forward
until its backward, so it is paid at every later block's forward, at the loss, and at every
later block's backward (:meth:`gradaccel.memory.profile.Profile.predict`). With ``D_i`` the bytes the
blocks before block ``i`` keep beyond their keep-nothing plans, the step's peak fits ``memory``
when

    D_i + need_i(p_i) <= memory   for every block i, and   D_n + head <= memory,

where ``need_i`` is block ``i``'s own forward and backward peak under its plan
(:meth:`Profile.need`). A dynamic programme over the blocks in forward order, with ``D`` as its
state (rounded up to ``memory / units`` bytes, so what it returns never exceeds the target),
finds the least recompute exactly on those terms. The same sums pay for differences a single
total of kept bytes cannot see: the last block's kept bytes are never live while another block
is rebuilt, so the last block keeps more; a block that is rebuilt with a larger working set
(more attention heads) makes the blocks before it keep less.
"""

import numpy as np

__all__ = ["least_recompute", "least_peak", "uncheckpointed"]


def uncheckpointed(prof, memory: int, layout: list | None = None) -> list | None:
    """Every block run without a checkpoint (``Profile.uncheckpointed``), where the step's predicted
    peak then fits ``memory``: nothing is recomputed, so no plan recomputes less, and no block's
    frontier is needed (at a predicted length, making it is most of the planning). None where
    it does not fit."""
    points = [prof.uncheckpointed(prof.kind_of[s]) for s in prof.step_terms(layout)["layout"]]
    return points if prof.predict(points, layout=layout)["peak"] <= memory else None


def least_recompute(prof, options: list, memory: int, layout: list | None = None, units: int = 4096,
                    exact: bool = True) -> list | None:
    """The plan of each block with the least total ``cost`` whose predicted peak fits.

    Args:
        prof: the step's :class:`gradaccel.memory.profile.Profile`.
        options: per block (position in ``layout``), its candidate points
            (``Profile.options``: checkpoint plans, and parts plans).
        memory: the most bytes the step's peak may reach (``Profile.predict``'s ``peak``).
        layout: as :meth:`Profile.predict`'s.
        units: the resolution of kept bytes (``memory / units``).
        exact: check the choice with the exact prediction (blocks run alone per plan) and tighten
            until it fits; otherwise the estimate (``Profile.block_peak_estimate``) decides.

    Returns:
        list | None: the chosen point per block, or None if no choice fits.
    """
    terms = prof.step_terms(layout)
    target = memory
    for _ in range(8):
        points = _solve(prof, terms, options, target, units)
        if points is None or not exact:
            return points
        over = prof.predict(points, exact=True, layout=layout)["peak"] - memory
        if over <= 0:
            return points
        target -= max(over, memory // units)
    return None


def least_peak(prof, options: list, layout: list | None = None, units: int = 4096) -> list:
    """The plan of each block whose predicted peak is least (estimated; to ``1 / units`` of
    keep-least's peak, by bisection). Keeping least everywhere is not always it: a block that
    keeps more may be rebuilt with a smaller working set, and the last block's kept bytes are
    only live at the loss."""
    terms = prof.step_terms(layout)
    least = [o[0] for o in options]
    hi = prof.predict(least, exact=False, layout=layout)["peak"]
    lo, best = terms["fixed"][0] - 1, least
    while hi - lo > max(1, hi // units):
        mid = (lo + hi) // 2
        points = _solve(prof, terms, options, mid, units)
        if points is None:
            lo = mid
        else:
            hi, best = mid, points
    return best


def _solve(prof, terms, options, memory, units):
    """The DP: per state (units kept beyond keep-nothing by the blocks so far), the least cost
    and, of plans of equal cost, the least predicted peak so far (``D_i + need_i``, ``D`` at the
    state's rounded bytes), and of those, the block's own least need. Plans that recompute the
    same (parts and tiles at any slice count) are told apart by their working set: the lower
    peak wins the tie."""
    if terms["fixed"][0] > memory or memory <= 0:
        return None
    unit = max(1, memory // units)
    cap = memory // unit
    inf = float("inf")
    best = np.full(cap + 1, inf)
    best[0] = 0.0  # best[u]: least cost so far with the blocks so far keeping u units beyond keep-nothing
    peak = np.full(cap + 1, inf)
    peak[0] = 0.0  # peak[u]: of best[u]'s plans, the least predicted peak so far
    at = np.arange(cap + 1, dtype=np.float64) * unit  # the bytes kept at each state

    def units_kept(i, p):  # what block i keeps beyond keep-nothing, in units, rounded up
        return -(-max(0, p.kept - prof.kind_of[terms["layout"][i]].zero.kept) // unit)

    picks = []
    for i, opts in enumerate(options):
        new = np.full(cap + 1, inf)
        new_peak = np.full(cap + 1, inf)
        pick = np.full(cap + 1, -1, dtype=np.int64)
        needs = [max(prof.need(terms, i, p, exact=False)) for p in opts]
        # Lowest own need first: of plans equal in cost and in the step's peak, the first stays.
        for j in sorted(range(len(opts)), key=needs.__getitem__):
            p, need = opts[j], needs[j]
            w = units_kept(i, p)
            room = memory - need
            if room < 0 or w > cap:
                continue
            top = min(room // unit, cap - w)  # states that may run this plan (u * unit >= the bytes kept)
            cand = best[:top + 1] + p.cost
            cand_peak = np.maximum(peak[:top + 1], at[:top + 1] + need)
            view, view_peak = new[w:w + top + 1], new_peak[w:w + top + 1]
            better = (cand < view) | ((cand == view) & (cand_peak < view_peak))
            view[better] = cand[better]
            view_peak[better] = cand_peak[better]
            pick[w:w + top + 1][better] = j
        best, peak = new, new_peak
        picks.append(pick)
    head = terms["head"][0]
    ok = np.arange(cap + 1) * unit + head <= memory
    if not np.isfinite(best[ok]).any():
        return None
    states = np.flatnonzero(ok)
    final = np.maximum(peak[states], at[states] + head)
    u = int(states[np.lexsort((final, best[states]))[0]])  # least cost; of equal ones, the least peak
    out = []
    for i in reversed(range(len(options))):
        p = options[i][int(picks[i][u])]
        out.append(p)
        u -= units_kept(i, p)
    return out[::-1]
