"""plan_report/plan_rows as a user reads them, and the budget paper cut (an int under 1 KiB)."""

import warnings

import pytest
import torch
import torch.nn as nn

import gradaccel
from gradaccel.checkpoint import plan_report, plan_rows, reset_plans


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
    block.fc1.p = 0.5  # a scalar attribute enters the signature: the region is planned again
    gradaccel.checkpoint(block, x, budget=0.5).sum().backward()
    rows = plan_rows()
    assert len(rows) == 1 and rows[0]["calls"] == 1  # the replaced plan is not shown
    row = rows[0]
    # Which addmm: the module that ran it stands beside the op.
    assert any(w.startswith("addmm (fc") for w in row["kept_where"] + row["replayed_where"]), row
    assert len(row["replayed_where"]) == len(row["replayed_ops"])
    report = plan_report()
    assert report.splitlines()[0].startswith("kept/budget/no-ckpt:")  # the legend
    assert report.splitlines()[-1].startswith("total (1 regions)")
    assert row["signature"] in report  # not truncated


def test_small_int_budget_is_loud():
    block, x = Block(), torch.randn(4, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="budget=3 is an int, so it means 3 bytes"):
        gradaccel.checkpoint(block, x, budget=3).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradaccel.checkpoint(block, x, budget=1.0).sum().backward()  # a fraction: nothing said
        gradaccel.checkpoint(block, x, budget=4096).sum().backward()  # plainly bytes
