"""gradaccel.checkpoint behaves as torch.utils.checkpoint.checkpoint(use_reentrant=False).

Each behaviour is run through both at several budgets and compared: outputs, gradients, and
what the caller can observe (RNG, hooks, identities, errors). Written from the behaviours torch
documents, not from its tests. Intended differences are listed in the README ("Differences from
`torch.utils.checkpoint`") and pinned at the end of this file.
"""

import warnings

import pytest
import torch
import torch.utils.checkpoint as tc

import gradaccel
from gradaccel.checkpoint import plan_rows, reset_plans

BUDGETS = [0.0, 0.5, 1.0]


def torch_ckpt(fn, *args, **kwargs):
    return tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def ours(budget):
    def run(fn, *args, **kwargs):
        return gradaccel.checkpoint(fn, *args, budget=budget, **kwargs)
    return run


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()  # every test traces its own regions and sees its own warnings
    yield
    reset_plans()


def _leaf(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(loss, inputs):
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _assert_same(got, expected):
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e, rtol=0, atol=0)  # same kernels, same order


def _both(fn, inputs, budget, calls=2, loss=lambda out: out.sum(), **kwargs):
    """Runs ``fn`` through torch's checkpoint and ours (``calls`` times: the trace, then the plan)
    and checks that outputs and gradients are equal."""
    for _ in range(calls):
        exp_out = torch_ckpt(fn, *inputs, **kwargs)
        expected = _grads(loss(exp_out), inputs)
        got_out = ours(budget)(fn, *inputs, **kwargs)
        got = _grads(loss(got_out), inputs)
        _assert_same(got, expected)
    return got_out, exp_out


# -- fallback is never silent ------------------------------------------------------------------
def _item_region(x):
    return x.sin() * x.sum().item()


def _nonzero_region(x):
    idx = (x > 0).nonzero()
    return x.sin()[idx[:, 0]].sum() + x.cos().sum()


def _mask_region(x):
    return x.sin()[x > 0].sum() + x.exp().sum()


@pytest.mark.parametrize("fn, op", [(_item_region, "aten._local_scalar_dense"), (_nonzero_region, "aten.nonzero"),
                                    (_mask_region, "aten.index.Tensor")])
def test_fallback_warns_once_and_names_the_op(fn, op):
    x = _leaf(6, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _both(fn, [x], 0.5, calls=1)
    ours_ = [str(w.message) for w in caught if "gradaccel" in str(w.message)]
    assert len(ours_) == 1 and op in ours_[0] and "torch.utils.checkpoint" in ours_[0], ours_
    (row,) = plan_rows()
    assert row["mode"].startswith("torch.utils.checkpoint") and row["fallback_reason"].startswith(op)
    assert op in gradaccel.plan_report()


def test_torch_only_option_warns_and_runs_as_torch():
    x = _leaf(4, 4)
    for kw in ({"determinism_check": "default", "debug": False, "early_stop": True}, {}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's defaults, spelled out: still ours, silently
            _both(torch.sin, [x], 0.5, **kw)
    with pytest.warns(UserWarning, match="determinism_check"):
        _both(torch.sin, [x], 0.5, determinism_check="none")
