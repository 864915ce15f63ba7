"""Nested plans (gradaccel/memory/parts.py): a keep-nothing checkpoint of the block around its
parts, so the step holds each block's input alone (on the host, with ``inputs_on_host``) and
backward rebuilds one part, one slice, at a time. The fit's prediction against the measured peak
(live bytes, CPU) and the gradients against stock PyTorch's."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from _models import hf_llama, token_batch  # noqa: E402
from gradaccel.memory.counter import measured_peak  # noqa: E402
from gradaccel.memory.fit import Planner, _least, hf_step  # noqa: E402
from gradaccel.memory.parts import is_nested  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, SEQ = 64, 1024, 4, 128, 2048  # a wide MLP: its rebuild sets the peak


def _model():
    return hf_llama(HIDDEN, INTER, LAYERS, VOCAB, SEQ)


def _batch():
    return token_batch(VOCAB, SEQ)


def test_least_plan_is_nested_and_measures_as_predicted():
    planner = Planner(_model(), optim="sgd")
    least = _least(planner, SEQ, 1, False, False, host=True)
    assert least.inputs_on_host and any(is_nested(b) for b in least.budgets), least.budgets
    assert "rebuilt as parts" in least.table()
    plain = _least(planner, SEQ, 1, False, False)  # the blocks' inputs kept, no nested plan chosen or not
    assert least.peak < plain.peak, (least.peak, plain.peak)

    gradaccel.reset_plans()
    model = _model()
    model, opt = least.apply(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    real = measured_peak(model, opt, hf_step, _batch())  # two steps, fit's terms (weights and state included)
    assert abs(least.peak / real - 1) <= 0.10, (least.peak, real)


def test_nested_gradients_equal_stock():
    """The least plan with its nested blocks and inputs on the host: the same gradients as the
    model without checkpointing (weight gradients sum over slices: fp32 tolerance)."""
    planner = Planner(_model(), optim="sgd")
    least = _least(planner, SEQ // 4, 1, False, False, host=True)
    assert any(is_nested(b) for b in least.budgets), least.budgets
    ref = _model()
    batch = {k: v[:, :SEQ // 4] for k, v in _batch().items()}
    hf_step(ref, batch).backward()
    gradaccel.reset_plans()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = least.apply(model, torch.optim.SGD(model.parameters(), lr=1.0))
    hf_step(model, batch).backward()
    assert opt.step()  # the fused window (one micro-batch) takes the gradients: p - 1.0 * grad
    worst = max(p.grad.abs().max().item() for p in ref.parameters())
    for (name, p), q, b in zip(model.named_parameters(), ref.parameters(), before):
        assert ((b - p.detach()) - q.grad).abs().max().item() <= 1e-5 * worst, name


def test_nested_with_host_inputs_follows_stock_as_the_length_changes(monkeypatch):
    """A batch is padded to its longest text, so the length changes every step: the least plan
    made for the longest (nested blocks, inputs on the host) trains as stock PyTorch does at each
    length, shorter, odd and back (fp32 tolerance: weight gradients sum over slices). Inputs go
    to the host where they are worth it (not at 77 tokens: under host_inputs.MIN_BYTES)."""
    from gradaccel.recompute import host_inputs
    parked = []
    worth = host_inputs._worth_parking
    monkeypatch.setattr(host_inputs, "_worth_parking", lambda x: parked.append(worth(x)) or parked[-1])
    planner = Planner(_model(), optim="sgd")
    least = _least(planner, SEQ // 4, 1, False, False, host=True)
    assert least.inputs_on_host and any(is_nested(b) for b in least.budgets), least.budgets
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gradaccel.reset_plans()
    model = _model()
    model, opt = least.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    full = _batch()
    for n in (SEQ // 4, 301, 77, SEQ // 4 - 1):
        parked.clear()
        batch = {k: v[:, :n] for k, v in full.items()}
        hf_step(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        hf_step(model, batch).backward()
        assert opt.step()
        opt.zero_grad()
        assert parked and all(parked) == (n > 77), (n, parked)
        worst = max(q.abs().max().item() for q in ref.parameters())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.detach() - q.detach()).abs().max().item() <= 1e-5 * worst, (n, name)
