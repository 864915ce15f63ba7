"""FusedAccumOptimizer's protocol for a framework's own accumulation loop (gradaccel/accumulate/framework.py):
what gradaccel.hf calls, tested without a framework."""

import pytest
import torch

from gradaccel import FusedAccumOptimizer


def _opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    return model, FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1, normalize="sum")


def test_note_backward_sums_the_window_loss_and_folded_params_are_the_models():
    model, opt = _opt()
    assert opt.folded_params == list(model.parameters()) and opt.process_group is None
    losses = []
    for k in (1.0, 2.0):  # a framework's window of two micro-batches, one step()
        loss = model(torch.randn(4, 5)).sum() * k
        loss.backward()
        opt.note_backward(loss.detach())
        losses.append(loss.item())
    assert opt.step()
    assert opt.window_loss == pytest.approx(sum(losses), rel=1e-6)


def test_release_hands_back_the_inner_optimizer_and_its_hooks_go():
    model, opt = _opt()
    model(torch.randn(4, 5)).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # folded into the window
    opt.clip_grad_norm_(1.0)  # finalized, not applied: still mid-window
    with pytest.raises(RuntimeError, match="mid-window"):
        opt.release()
    assert opt.step()
    inner = opt.release()
    assert isinstance(inner, torch.optim.SGD) and inner is opt.optimizer
    model(torch.randn(4, 5)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # no fold hook left
