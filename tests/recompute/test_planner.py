"""The C++ checkpoint planner (gradaccel/ops/csrc/planner.cpp) on its own, against brute force.

Random small graphs of ops and values, every keep/drop choice enumerated, each costed by a
replay written here independently of the C++: where the planner says its plan is exact, no plan
within the budget replays for less, and the plan's own bytes and cost are what it claims. Its
offload greedy and generator-state accounting are checked against the rule they replaced (a
Python loop over ``replay``), and a region is planned in one call.
"""

import itertools
import math
import random
import sys

import pytest

import gradaccel
from gradaccel.ops import extension as _ext


def _random_problem(rng: random.Random):
    """A region of 3-9 ops, each making one new storage from earlier values or the region's inputs."""
    n_inputs, n_ops = rng.randint(1, 2), rng.randint(3, 9)
    value_producer = [-1] * n_inputs
    value_storage = list(range(n_inputs))
    op_cost, op_replayable, op_inputs = [], [], []
    for op in range(n_ops):
        k = rng.randint(1, min(3, len(value_producer)))
        op_inputs.append(rng.sample(range(len(value_producer)), k))
        op_cost.append(float(rng.choice([0, 1, 5, 40, 300])))
        op_replayable.append(rng.random() > 0.15)
        value_producer.append(op)
        value_storage.append(len(value_storage))
    n_storages = len(value_storage)
    # The region's inputs are available; now and then an input is not (cannot be replayed from).
    storage_available = [s < n_inputs and rng.random() > 0.1 for s in range(n_storages)]
    produced = list(range(n_inputs, n_storages))
    candidates = sorted(rng.sample(produced, rng.randint(1, min(8, len(produced)))))
    candidate_bytes = [rng.choice([0, 4, 16, 64, 256]) for _ in candidates]
    candidate_value = list(candidates)  # one value per storage: its value is its own id
    value_leaf = [True] * len(value_producer)
    op_random = [rng.random() < 0.3 for _ in range(n_ops)]
    args = (op_cost, op_replayable, op_inputs, value_producer, value_storage, value_leaf,
            storage_available, candidates, candidate_bytes, candidate_value, op_random)
    return args


def _replay_cost(args, kept) -> float:
    """Cost of rebuilding every dropped candidate from what is available: each op paid once."""
    (op_cost, op_replayable, op_inputs, value_producer, value_storage, _leaf,
     storage_available, candidates, _bytes, candidate_value, _random) = args
    available = set(s for s, a in enumerate(storage_available) if a)
    available |= {c for c, k in zip(candidates, kept) if k}
    needed_ops = set()

    def need(v) -> bool:
        if value_storage[v] in available:
            return True
        op = value_producer[v]
        if op < 0 or not op_replayable[op]:
            return False
        if op not in needed_ops:
            needed_ops.add(op)
            return all(need(i) for i in op_inputs[op])
        return True

    if not all(need(v) for v, k in zip(candidate_value, kept) if not k):
        return math.inf
    return sum(op_cost[op] for op in needed_ops)


@pytest.mark.parametrize("seed", range(60))
def test_exact_plans_match_brute_force(seed):
    rng = random.Random(seed)
    args = _random_problem(rng)
    problem = _ext.load().PlanProblem(*args)
    sizes = args[8]
    budget = rng.choice([0, sum(sizes) // 3, sum(sizes) // 2, sum(sizes)])
    best = min((_replay_cost(args, kept) for kept in itertools.product([False, True], repeat=len(sizes))
                if sum(b for b, k in zip(sizes, kept) if k) <= budget), default=math.inf)
    r = problem.plan(budget)
    kept, ops, cost, exact, fits = r.kept, r.steps, r.cost, r.exact, r.fits
    assert not any(r.offloaded) and r.budget == budget  # neither offload nor RNG accounting asked for
    assert exact or not fits  # graphs this small never reach the node limit
    if math.isinf(best):
        assert not fits  # nothing within the budget can be rebuilt: the planner must say so
        return
    assert fits
    assert sum(b for b, k in zip(sizes, kept) if k) <= budget
    assert cost == pytest.approx(best, rel=1e-12, abs=0)
    assert _replay_cost(args, kept) == pytest.approx(cost, rel=1e-12, abs=0)
    assert sum(args[0][op] for op in ops) == pytest.approx(cost, rel=1e-12, abs=0)


@pytest.mark.parametrize("seed", range(20))
def test_replay_costs_what_brute_force_costs(seed):
    rng = random.Random(1000 + seed)
    args = _random_problem(rng)
    problem = _ext.load().PlanProblem(*args)
    for _ in range(8):
        kept = [rng.random() < 0.5 for _ in args[7]]
        cost, ops = problem.replay(kept)
        assert cost == pytest.approx(_replay_cost(args, kept), rel=1e-12, abs=0)


def test_bad_arrays_are_refused():
    with pytest.raises(RuntimeError, match="op arrays differ"):
        _ext.load().PlanProblem([1.0], [True, False], [[0]], [-1], [0], [True], [True], [], [], [])
    with pytest.raises(RuntimeError, match="op arrays differ"):
        _ext.load().PlanProblem([1.0], [True], [[0]], [-1], [0], [True], [True], [], [], [], [True, False])


def _old_rule(problem, budget, rng_bytes, copy_cost, op_random, nbytes):
    """What gradaccel planned before the planner took it in: plan; with offload, the Python greedy
    over ``replay``; where the replay (or its fallback) draws random numbers, all of it again with
    the generator state's bytes off the budget."""
    def once(b):
        base = problem.plan(b)
        mask, offloaded, steps, cost = list(base.kept), [False] * len(nbytes), base.steps, base.cost
        while copy_cost is not None:
            best = None
            for i in range(len(nbytes)):
                if mask[i] or nbytes[i] == 0:
                    continue
                mask[i] = True
                saved = cost - problem.replay(mask)[0]
                mask[i] = False
                gain = (saved - copy_cost * nbytes[i]) / nbytes[i]
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, i)
            if best is None:
                break
            mask[best[1]] = offloaded[best[1]] = True
            cost, steps = problem.replay(mask)
        return dict(kept=list(base.kept), offloaded=offloaded, steps=list(steps), cost=cost, exact=base.exact,
                    fits=base.fits, budget=b, fallback_steps=list(base.steps), fallback_cost=base.cost)

    old = once(budget)
    if any(op_random[i] for i in old["fallback_steps"]) or any(op_random[i] for i in old["steps"]):
        old = once(max(0, budget - rng_bytes))
    return old


@pytest.mark.parametrize("seed", range(60))
def test_offload_and_rng_accounting_match_the_old_rule(seed):
    rng = random.Random(5000 + seed)
    args = _random_problem(rng)
    problem = _ext.load().PlanProblem(*args)
    op_cost, op_random, sizes = args[0], args[10], args[8]
    budget = rng.choice([0, sum(sizes) // 3, sum(sizes) // 2, sum(sizes)])
    rng_bytes = rng.choice([0, 4, 64, 1000])
    copy_cost = rng.choice([None, 0.0, 0.05, 0.5, 3.0, 1e9])
    r = problem.plan(budget, rng_bytes=rng_bytes, copy_cost_per_byte=copy_cost)
    got = {k: getattr(r, k) for k in ("kept", "offloaded", "steps", "cost", "exact", "fits", "budget",
                                      "fallback_steps", "fallback_cost")}
    assert got == _old_rule(problem, budget, rng_bytes, copy_cost, op_random, sizes)  # costs too, bit for bit
    # What the plan claims, by brute force: a replay of random ops leaves room for the generator
    # state (as much as the budget has)...
    assert r.uses_rng == any(op_random[i] for i in r.fallback_steps)
    assert r.budget in (budget, max(0, budget - rng_bytes))
    if r.uses_rng:
        assert r.budget == max(0, budget - rng_bytes)
    if r.fits:
        assert sum(b for b, k in zip(sizes, r.kept) if k) <= r.budget
    # ... and offload pays: the replay left costs what it says, and less than the copies saved.
    at_hand = [k or o for k, o in zip(r.kept, r.offloaded)]
    assert r.cost == pytest.approx(_replay_cost(args, at_hand), rel=1e-12, abs=0)
    assert sum(op_cost[i] for i in r.steps) == pytest.approx(r.cost, rel=1e-12, abs=0)
    sent = sum(b for b, o in zip(sizes, r.offloaded) if o)
    if sent:
        assert r.cost + copy_cost * sent < r.fallback_cost
        assert not any(k and o for k, o in zip(r.kept, r.offloaded))


def test_a_region_is_planned_in_one_call(monkeypatch):
    """A ``Region`` plans with one call of the C++ planner, offload and generator state included."""
    import torch

    from gradaccel.recompute import plan as _plan
    from gradaccel.recompute.state import STATE

    ckpt = sys.modules["gradaccel.recompute.checkpoint"]
    region_mod = sys.modules["gradaccel.recompute.region"]
    monkeypatch.setattr(region_mod, "offload_cost_per_byte", lambda device, cost: 1e-9)  # copies priced as free
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    ckpt.reset_plans()
    gradaccel.checkpoint(model, torch.randn(16, 64, requires_grad=True), budget=0.5,
                         offload=True).sum().backward()
    (traced,) = STATE.regions[model].values()
    calls, real = [], _plan._problem

    class Counting:
        def __init__(self, problem):
            self.problem = problem

        def plan(self, *a, **kw):
            calls.append("plan")
            return self.problem.plan(*a, **kw)

        def replay(self, *a, **kw):
            calls.append("replay")
            return self.problem.replay(*a, **kw)

    monkeypatch.setattr(_plan, "_problem", lambda *a: Counting(real(*a)))
    region = region_mod.Region("again", traced.graph, 0.5, [], traced.store)
    ckpt.reset_plans()
    assert calls == ["plan"]
    plan = region.plan
    assert plan.steps == traced.plan.steps and plan.offloaded == traced.plan.offloaded
    # The path under test ran: copies went to host, and the fallback replays dropout.
    assert plan.offloaded and plan.fallback is not None and plan.needs_rng
    rng = _plan.rng_state_bytes(traced.graph)
    assert plan.budget_bytes == int(0.5 * traced.graph.activation_bytes) - rng
