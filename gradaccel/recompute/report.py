"""What the plans of ``gradaccel.checkpoint`` are: :func:`plan_rows` (the data) and
:func:`plan_report` (a table for people).

A region is one callable at one input signature; a model trained at many lengths has a plan per
block and length. The report shows the step the user is on: each block's latest plan, named by
its position in the model (``model.layers.3``, known for models passed to ``checkpoint_blocks``),
with the totals one step holds, and one line over every length. ``plan_report(all_plans=True)``
lists every live plan."""

import weakref

from gradaccel.recompute.state import STATE
from gradaccel.recompute.trace import Graph, Opaque

__all__ = ["plan_rows", "plan_report", "remember_model"]

# Models handed to checkpoint_blocks (any route): where a block's position comes from. Not in
# STATE: reset_plans() forgets plans, not which models were set up.
_MODELS = weakref.WeakSet()
_MIB = 1 / 2**20


def remember_model(model) -> None:
    """Names the blocks of ``model`` in reports by their position in it (``model.layers.3``)."""
    _MODELS.add(model)


def describe(reason: str) -> str:
    """The op that made a trace data dependent, with the Python that usually runs it."""
    hints = {"aten._local_scalar_dense": "Tensor.item(), or a tensor used as a Python number or bool",
             "aten.nonzero": "nonzero(), torch.where(mask) or boolean-mask indexing",
             "aten.index.Tensor": "boolean-mask indexing"}
    hint = next((h for op, h in hints.items() if reason.startswith(op)), None)
    return f"{reason} ({hint})" if hint else reason


def _owners() -> tuple[dict, set]:
    """(id of each live region -> (order, position) in its model or None, ids of the latest
    regions): per callable and structure (its signature without sizes: one block, one segment),
    the region it ran last. A callable's regions are kept most recently used last
    (gradaccel/recompute/checkpoint.py)."""
    positions = {}
    for model in list(_MODELS):
        for k, (name, module) in enumerate(model.named_modules()):
            positions.setdefault(id(module), (k, name or type(model).__name__))
    where, latest = {}, set()
    for owner, regions in list(STATE.regions.items()):
        last = {}
        for r in regions.values():
            if not getattr(r, "retired", False):
                where[id(r)] = positions.get(id(owner))
                last[id(r.structure) if r.structure is not None else None] = r
        latest.update(id(r) for r in last.values())
    return where, latest


def plan_rows() -> list[dict]:
    """One dict per live traced region: name, ``position`` (the block's name in its model, such as
    ``"model.layers.3"``, where it was set up by ``checkpoint_blocks``; else None), ``latest`` (this
    is the plan its callable ran last: the step the user is on), signature, calls, ``made``
    (``"traced"``, or ``"sized"``: planned from size formulas, with no trace), ``lengths`` (the calls of its
    signature without sizes: how many were ``traced``, ``sized`` and ``planned`` (ran a plan
    already made), and ``not_sized``: why new sizes are traced, "" where they are sized), bytes held against the budget,
    ops kept, replayed and offloaded (``kept_where``/``replayed_where``: the same with the
    submodule that ran each, as ``"mm (mlp.fc1)"``), estimated recompute FLOPs, ``recompute_cost``
    (what the planner minimises, in its cost model's units: see ``cost``), ``replay_peak_bytes`` (the
    most bytes backward's replay of the region makes that are alive at once), whether the plan is exact, and
    ``priced_ops``: the ops with no FLOP formula and how their cost was found (``"measured"``
    in the traced forward, or a conservative ``"bound"``)."""
    return [row for row, _, _ in _rows()]


def _rows() -> list[tuple]:
    """(plan_rows' row, its structure or None, its position's order in its model or None) per
    live region."""
    where, latest = _owners()
    rows = []
    for ref in STATE.in_order:
        region = ref()
        if region is None or getattr(region, "retired", False):
            continue
        plan, graph = region.plan, region.graph
        position = where.get(id(region))
        row = {"region": region.name, "position": position[1] if position else None,
               "latest": id(region) in latest, "signature": region.signature, "calls": region.calls,
               "budget": region.budget, "total_bytes": graph.activation_bytes,
               "made": "sized" if getattr(region, "sized", False) else "traced"}
        s = region.structure
        if s is not None:  # every call of its structure (all its lengths), and why new ones are traced
            row["lengths"] = {"traced": s.traces, "sized": s.sized, "planned": s.planned, "not_sized": s.why}
        if plan is None:
            row.update(mode=f"torch.utils.checkpoint ({describe(graph.dynamic_reason)})",
                       fallback_reason=graph.dynamic_reason)
        else:
            kept = sorted({_producer_name(graph, p.storage) for k, p in enumerate(graph.packs)
                           if plan.keep[k] and graph.storages[p.storage].creator >= 0})
            row.update(mode="selective", kept_bytes=plan.kept_bytes, budget_bytes=plan.budget_bytes,
                       kept_ops=kept, replayed_ops=[str(graph.ops[i].func) for i in plan.steps],
                       offloaded_ops=sorted({_producer_name(graph, s) for s in plan.offloaded}),
                       offloaded_bytes=plan.offloaded_bytes,
                       recompute_flops=plan.recompute_flops, recompute_cost=plan.cost, exact=plan.exact,
                       fits=plan.fits, replay_peak_bytes=plan.replay_peak,
                       priced_ops={str(op.func): op.priced for op in graph.ops if op.priced != "formula"},
                       kept_where=sorted({_where(graph, graph.storages[p.storage].creator) for k, p in enumerate(graph.packs)
                                          if plan.keep[k] and graph.storages[p.storage].creator >= 0}),
                       replayed_where=[_where(graph, i) for i in plan.steps],
                       split=[str(op.func) for op in graph.ops if isinstance(op.func, Opaque)])
        rows.append((row, s, position[0] if position else None))
    return rows


def _where(graph: Graph, i: int) -> str:
    op = graph.ops[i]
    name = str(op.func).removeprefix("aten.").removesuffix(".default")
    return f"{name} ({op.module})" if op.module else name


def _producer_name(graph: Graph, sid: int) -> str:
    return str(graph.ops[graph.storages[sid].creator].func)


def plan_report(all_plans: bool = False) -> str:
    """A readable table of the plans (see :func:`plan_rows`).

    Args:
        all_plans: False (default): the step the user is on, each region's latest plan (one row
            per block, at the latest length), named by its position in the model where
            ``checkpoint_blocks`` set it up, the totals of that one step, and one line over
            every plan of every length. True: every live plan, with totals over all of them
            (bytes never held at once) and each callable's calls over the lengths.

    Returns:
        str: the table, one line a row.
    """
    every = _rows()
    shown = every if all_plans else sorted((x for x in every if x[0]["latest"]),
                                           key=lambda x: (x[2] is None, x[2] or 0))
    rows = [row for row, _, _ in shown]
    label = f"sum of all {len(rows)} (never held)" if all_plans else f"total, one step ({len(rows)} regions)"
    width = max([len(label)] + [len(_name(r)) for r in rows])  # names whole: a position can be long
    lines = ["kept/budget/no-ckpt: activation MiB a region holds for backward with this plan / may hold / "
             "would hold without checkpointing; replayed: ops rerun in backward; exact: the plan is proven "
             "least-cost; costs: ops with no FLOP formula, measured in the traced forward or bounded.",
             f"{'block':<{width}} {'kept MiB':>9} {'budget MiB':>10} {'no-ckpt MiB':>11} {'replayed':>8} "
             f"{'recompute GFLOP':>15}  exact  signature"]
    same_as = None  # (the row whose ops were listed last, its ops)
    for r in rows:
        ops = (r.get("kept_where"), r.get("replayed_where"))
        again = same_as is not None and same_as[1] == ops
        lines += _row(r, width, None if not again else "above" if all_plans else _name(same_as[0]))
        if not again:
            same_as = (r, ops)
    selective = [r for r in rows if r["mode"] == "selective"]
    lines.append(f"{label:<{width}} {_mib(selective, 'kept_bytes'):>9.2f} {_mib(selective, 'budget_bytes'):>10.2f} "
                 f"{_mib(selective, 'total_bytes'):>11.2f} {'':>8} "
                 f"{sum(r['recompute_flops'] for r in selective) / 1e9:>15.4f}")
    lines += _calls_by_callable(every) if all_plans else _over_all_plans(every)
    return "\n".join(lines)


def _name(r) -> str:
    return r["position"] or r["region"]


def _mib(rows, key) -> float:
    return sum(r[key] for r in rows) * _MIB


def _row(r, width, same_as) -> list[str]:
    """One region's lines; its ops are not listed again where they are those of ``same_as`` (the
    name of a row above)."""
    if r["mode"] != "selective":
        return [f"{_name(r):<{width}} {r['mode']}  {r['signature']}"]
    lines = [f"{_name(r):<{width}} {r['kept_bytes'] * _MIB:>9.2f} {r['budget_bytes'] * _MIB:>10.2f} "
             f"{r['total_bytes'] * _MIB:>11.2f} {len(r['replayed_ops']):>8} {r['recompute_flops'] / 1e9:>15.4f}  "
             f"{'yes' if r['exact'] else 'no ':<5}  {r['signature']}"]
    if same_as is not None:
        lines.append(f"    kept, replayed: the same ops as {same_as}")
    else:
        lines.append(f"    kept:     {', '.join(r['kept_where']) or '-'}")
        lines.append(f"    replayed: {', '.join(r['replayed_where']) or '-'}")
    if r["split"]:
        lines.append(f"    split:    {', '.join(r['split'])}")
    if r["offloaded_ops"]:
        lines.append(f"    offloaded ({r['offloaded_bytes'] * _MIB:.2f} MiB to host): {', '.join(r['offloaded_ops'])}")
    if r["priced_ops"]:
        lines.append("    costs:    " + ", ".join(f"{k} ({v})" for k, v in r["priced_ops"].items()))
    return lines


def _over_all_plans(every) -> list[str]:
    """One line over every live plan: how many, at how many input signatures, how their calls
    were planned, and the range of what the plans of one signature keep together."""
    if not every:
        return []
    rows = [row for row, _, _ in every]
    structures = {id(s): s for _, s, _ in every if s is not None}.values()
    kept = {}
    for r in rows:
        if r["mode"] == "selective":
            kept[r["signature"]] = kept.get(r["signature"], 0) + r["kept_bytes"]
    spread = f"; kept per signature {min(kept.values()) * _MIB:.2f} to {max(kept.values()) * _MIB:.2f} MiB" \
        if len(kept) > 1 else ""
    signatures = len({r["signature"] for r in rows})
    return [f"all plans: {len(rows)} at {signatures} input signature{'s' if signatures > 1 else ''}; calls traced "
            f"{sum(s.traces for s in structures)} (a full recompute each), sized {sum(s.sized for s in structures)} "
            f"(from size formulas), planned {sum(s.planned for s in structures)} (a plan made before){spread}; "
            "plan_report(all_plans=True) lists each"]


def _calls_by_callable(every) -> list[str]:
    """Per callable, its calls over every length: traced, sized from formulas, planned."""
    found = {}
    for row, s, _ in every:
        if s is not None:
            found.setdefault(row["region"], {})[id(s)] = s
    lines = ["calls over all lengths: traced (a full recompute each), sized (planned from size formulas, no "
             "trace), planned (a plan made before)"] if found else []
    for name, structures in found.items():
        s = list(structures.values())
        why = next((x.why for x in s if x.why), "")
        lines.append(f"{name[:28]:<28} traced {sum(x.traces for x in s)}, sized {sum(x.sized for x in s)}, "
                     f"planned {sum(x.planned for x in s)}" + (f"; new sizes traced: {why}" if why else ""))
    return lines
