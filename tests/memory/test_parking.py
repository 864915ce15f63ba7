"""Block inputs on the host within a host budget (gradaccel/memory/parking.py): the layouts a
budget allows, each layout's predicted peak against the measured one (live bytes, CPU) with the
gradients of stock PyTorch, and the fit and ``memory=`` keeping their host bytes within the budget."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from _models import hf_llama, token_batch  # noqa: E402
from gradaccel.memory.counter import measured_peak  # noqa: E402
from gradaccel.memory.fit import Planner, _evaluate, _least, hf_step  # noqa: E402
from gradaccel.memory.parking import (DEVICE, HOST, PAIR, PAIRED, default_host_memory, describe,  # noqa: E402
                                      host_budget, parkings)
from gradaccel.memory.parts import is_sliced  # noqa: E402
from gradaccel.recompute.block_plan import plan_of  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, SEQ = 128, 512, 6, 64, 1024
INPUT = SEQ * HIDDEN * 4  # one block input, fp32


def _model():
    return hf_llama(HIDDEN, INTER, LAYERS, VOCAB, SEQ)


def _batch():
    return token_batch(VOCAB, SEQ)


def test_layouts_a_budget_allows():
    every = parkings([10] * 6, None, [True] * 6)
    assert every == [(HOST,) * 6] == parkings([10] * 6, 60, [True] * 6)
    found = parkings([0] + [10] * 5, 30, [True] * 6)  # block 0's input stays (a leaf): 0 bytes
    assert [describe(r) for r in found] == ["0-3 parked; 4-5 on device", "0-1 in pairs; 2-4 parked; 5 on device",
                                            "0-3 in pairs; 4-5 parked"]
    for roles in found:
        assert sum(b for r, b in zip(roles, [0] + [10] * 5) if r in (HOST, PAIR)) <= 30
    assert parkings([10] * 4, 15, [False] * 4) == [(HOST, DEVICE, DEVICE, DEVICE)]  # no pairs without sliced blocks
    assert host_budget("16GiB") == (16 << 30, "given") and host_budget(float("inf"))[0] is None
    budget, how = default_host_memory()
    assert budget is None or (budget > 0 and "available memory" in how)
    with pytest.raises(ValueError, match="host_memory"):
        host_budget("lots")


@pytest.mark.parametrize("roles", [(PAIR, PAIRED, HOST, HOST, DEVICE, DEVICE), (PAIR, PAIRED) * 3,
                                   (HOST, PAIR, PAIRED, HOST, PAIR, PAIRED), (DEVICE,) * 6],
                         ids=describe)
def test_layout_measures_as_predicted_and_trains_as_stock(roles):
    """Every block sliced, inputs parked, kept, or in pairs: the predicted step peak against the
    measured one (weights and optimizer state included), and gradients against stock's (fp32:
    sums over slices)."""
    planner = Planner(_model(), optim="sgd", device="cuda")  # as for an accelerator: on a CPU device no host plans
    prof = planner.profile(SEQ, 1)
    fronts = planner.fronts(prof, host=roles)
    points = [next(p for p in opts if is_sliced(p.plan)) for opts in fronts]
    plan = _evaluate(planner, SEQ, 1, 1, points, host=roles)
    assert plan.parking == roles and plan.host["block inputs (inputs_on_host)"] == INPUT * sum(r in (HOST, PAIR)
                                                                                                for r in roles)
    gradaccel.reset_plans()
    model = _model()
    model, opt = plan.apply(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    real = measured_peak(model, opt, hf_step, _batch())
    assert abs(plan.peak / real - 1) <= 0.01, (plan.peak, real)

    ref = _model()
    hf_step(ref, _batch()).backward()
    gradaccel.reset_plans()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = plan.apply(model, torch.optim.SGD(model.parameters(), lr=1.0))
    hf_step(model, _batch()).backward()
    assert opt.step()
    worst = max(p.grad.abs().max().item() for p in ref.parameters())
    for (name, p), q, b in zip(model.named_parameters(), ref.parameters(), before):
        assert ((b - p.detach()) - q.grad).abs().max().item() <= 1e-5 * worst, name


def test_pairs_recompute_a_forward_more():
    planner = Planner(_model(), optim="sgd", device="cuda")  # as for an accelerator: on a CPU device no host plans
    prof = planner.profile(SEQ, 1)
    alone, paired = (next(p for p in opts if is_sliced(p.plan)) for opts in
                     (planner.fronts(prof, host=True)[2], planner.fronts(prof, host=(PAIR, PAIRED) * 3)[2]))
    assert paired.cost == pytest.approx(alone.cost + prof.kind_of[2].forward_cost)


def test_fit_keeps_within_the_host_budget():
    """The least plan under budgets of every input, three, and none: its parked bytes within each,
    its device peak no lower where the budget is smaller, and the table states the budget."""
    planner = Planner(_model(), optim="sgd", device="cuda")  # as for an accelerator: on a CPU device no host plans
    peaks = []
    for budget in (True, 3 * INPUT, 0):
        least = _least(planner, SEQ, 1, False, False, host=budget)
        parked = least.host.get("block inputs (inputs_on_host)", 0)
        assert budget is True or parked <= budget, (budget, parked)
        peaks.append(least.peak)
    assert peaks[0] <= peaks[1] <= peaks[2], peaks
    plan = planner.fit(SEQ, 1, peaks[1] + 1, slack=0, host_memory=3 * INPUT)
    assert plan.fits and sum(plan.host.values()) <= 3 * INPUT and plan.host_memory == 3 * INPUT
    assert "host budget" in plan.table() and "(given)" in plan.table()


def test_memory_target_keeps_within_the_host_budget():
    """checkpoint_blocks(memory=, inputs_on_host=True, host_memory=): every plan with the inputs
    on the host, room there for two of six: the plan parks no more than two (the others kept, or
    in pairs), sets each block so, and trains as stock."""
    from gradaccel.memory.target import MemoryTarget

    batch = _batch()
    gradaccel.reset_plans()
    ref = _model()
    hf_step(ref, batch).backward()
    model = gradaccel.checkpoint_blocks(_model(), memory=1, inputs_on_host=True, host_memory=2 * INPUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # memory=1: below the least, as meant
        hf_step(model, batch).backward()
    target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    roles = next(iter(target.hosts.values()))
    assert isinstance(roles, tuple) and sum(r in (HOST, PAIR) for r in roles) <= 2, roles
    for layer, role in zip(model.model.layers, roles):
        assert plan_of(layer).parked == (role in (HOST, PAIR))
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="host_memory"):
        gradaccel.checkpoint_blocks(_model(), host_memory="1GiB")
