"""plan_report/plan_rows as a user reads them (the step the user is on by default, every plan on
request), and the budget paper cut (an int under 1 KiB)."""

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
    assert report.splitlines()[-1].startswith("all plans: 1 at 1 input signature;")
    assert report.splitlines()[-2].startswith("total, one step (1 regions)")
    assert row["position"] is None and row["latest"]  # a plain checkpoint call: named by its callable
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


def test_report_is_the_step_the_user_is_on():
    """After several lengths, the report shows each block's latest plan by its position in the
    model, the totals that one step holds, and one line over every length; all_plans=True lists
    every plan. plan_rows() keeps every live plan, each marked latest or not."""
    transformers = pytest.importorskip("transformers")
    reset_plans()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, vocab_size=128)
    model = transformers.LlamaForCausalLM(config).train()
    gradaccel.checkpoint_blocks(model, budget=0.5)
    lengths = (24, 40, 32, 48, 40)  # the step the user is on: 40 tokens
    for seq in lengths:
        ids = torch.randint(0, 128, (1, seq))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    rows = plan_rows()
    latest = [r for r in rows if r["latest"]]
    assert len(rows) == 4 * len(set(lengths)) and len(latest) == 4
    assert sorted(r["position"] for r in latest) == [f"model.layers.{i}" for i in range(4)]
    assert all(r["signature"].startswith("(1, 40, 32)") for r in latest), latest

    lines = plan_report().splitlines()
    blocks = [line for line in lines if line.startswith("model.layers.")]
    assert [line.split()[0] for line in blocks] == [f"model.layers.{i}" for i in range(4)]
    assert all("(1, 40, 32)" in line for line in blocks)
    (total,) = [line for line in lines if line.startswith("total, one step (4 regions)")]
    kept_mib = float(total.split(")", 1)[1].split()[0])
    assert kept_mib == pytest.approx(sum(r["kept_bytes"] for r in latest) / 2**20, abs=0.006)
    assert kept_mib < sum(r["kept_bytes"] for r in rows) / 2**20 / 2  # not a sum over every length
    assert lines[-1].startswith(f"all plans: {len(rows)} at {len(set(lengths))} input signatures")
    assert len(lines) < 20, lines  # a screen, not a line per plan

    every = plan_report(all_plans=True).splitlines()
    assert sum(line.startswith("model.layers.") for line in every) == len(rows)
    assert any(line.startswith(f"sum of all {len(rows)}") for line in every)
    assert any(line.startswith("LlamaDecoderLayer.forward") and "traced" in line for line in every)


def test_every_segment_of_the_latest_step_is_shown():
    """checkpoint_sequential's segments share one function: each is a block of the step, so the
    report shows each segment's latest plan, not only the last segment's."""
    reset_plans()
    torch.manual_seed(0)
    layers = nn.Sequential(*(Block() for _ in range(6)))
    for rows in (4, 8, 6):
        x = torch.randn(rows, 16, requires_grad=True)
        gradaccel.checkpoint_sequential(layers, 3, x, budget=0.5).sum().backward()
    latest = [r for r in plan_rows() if r["latest"]]
    assert len(latest) == 2 and all(r["signature"].startswith("(6, 16)") for r in latest), latest
    assert plan_report().splitlines()[-2].startswith("total, one step (2 regions)")
