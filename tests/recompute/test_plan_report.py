"""plan_report/plan_rows as a user reads them, and the budget paper cut (an int under 1 KiB)."""

import warnings

import pytest
import torch
import torch.nn as nn

import gradaccel
from gradaccel.recompute.checkpoint import plan_report, plan_rows, reset_plans


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


def test_report_names_modules_totals_and_no_stale_rows():
    reset_plans()
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        gradaccel.checkpoint(block, x, budget=0.5).sum().backward()
    row = plan_rows()[0]
    # Which addmm: the module that ran it stands beside the op.
    assert any(w.startswith("addmm (fc") for w in row["kept_where"] + row["replayed_where"]), row
    assert len(row["replayed_where"]) == len(row["replayed_ops"])
    report = plan_report()
    assert report.splitlines()[0].startswith("kept/budget/no-ckpt:")  # the legend
    assert report.splitlines()[-1].startswith("total (1 regions)")
    assert row["signature"] in report  # not truncated


def test_a_replanned_region_leaves_no_stale_row():
    reset_plans()
    lin = nn.Linear(8, 8)
    state = type("State", (), {"act": torch.relu})()  # read through a plain object: not in the signature

    def region(x):
        return state.act(lin(x))

    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        gradaccel.checkpoint(region, x, budget=0.5).sum().backward()
    state.act = torch.sigmoid  # saves other tensors: detected, traced again on the next call
    with pytest.warns(UserWarning, match="traced again"):
        gradaccel.checkpoint(region, x, budget=0.5).sum().backward()
    gradaccel.checkpoint(region, x, budget=0.5).sum().backward()
    rows = plan_rows()
    assert len(rows) == 1 and rows[0]["calls"] == 1, rows


def test_small_int_budget_is_loud():
    block, x = Block(), torch.randn(4, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="budget=3 is an int, so it means 3 bytes"):
        gradaccel.checkpoint(block, x, budget=3).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradaccel.checkpoint(block, x, budget=1.0).sum().backward()  # a fraction: nothing said
        gradaccel.checkpoint(block, x, budget=4096).sum().backward()  # plainly bytes
