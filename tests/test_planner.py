"""The C++ checkpoint planner (csrc/planner.cpp) on its own, against brute force.

Random small graphs of ops and values, every keep/drop choice enumerated, each costed by a
replay written here independently of the C++: where the planner says its plan is exact, no plan
within the budget replays for less, and the plan's own bytes and cost are what it claims.
"""

import itertools
import math
import random

import pytest

from gradaccel import _ext


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
    args = (op_cost, op_replayable, op_inputs, value_producer, value_storage, value_leaf,
            storage_available, candidates, candidate_bytes, candidate_value)
    return args


def _replay_cost(args, kept) -> float:
    """Cost of rebuilding every dropped candidate from what is available: each op paid once."""
    (op_cost, op_replayable, op_inputs, value_producer, value_storage, _leaf,
     storage_available, candidates, _bytes, candidate_value) = args
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
    kept, ops, cost, exact, fits = problem.plan(budget)
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
