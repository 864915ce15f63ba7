"""The replay frees as it goes: a block's step under gradaccel's replay peaks no higher than under
``torch.utils.checkpoint``, in exact bytes (gradaccel.memory.LiveBytes), with gradients equal to
stock; and the plan's own sweep of its replay (``Plan.replay_peak``) is the peak a real replay
measures, byte for byte."""

import warnings

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import gradaccel
from gradaccel.memory import LiveBytes
from gradaccel.recompute.checkpoint import plan_rows, reset_plans
from gradaccel.recompute.plan import Plan
from tests._models import Block, GPTConfig

transformers = pytest.importorskip("transformers")


class LoRALinear(nn.Module):
    """``base(x) + (x @ A) @ B * s`` over a frozen base: the shape of a peft adapter."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(base.in_features, r) / r)
        self.B = nn.Parameter(torch.randn(r, base.out_features) / base.out_features)

    def forward(self, x):
        return self.base(x) + (x @ self.A) @ self.B * 2.0


def _with_lora(block: nn.Module) -> nn.Module:
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child))
    return block


def _llama(hidden, inter, tokens, lora):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = LlamaDecoderLayer(cfg, layer_idx=0).train()
    x = torch.randn(1, tokens, hidden)
    with torch.no_grad():
        cos_sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(tokens)[None])
    return (_with_lora(block) if lora else block), x, {"position_embeddings": cos_sin}


def _gpt(hidden, tokens, lora):
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=tokens, n_embd=hidden, n_head=4, dropout=0.1)).train()
    return (_with_lora(block) if lora else block), torch.randn(2, tokens, hidden), {}


CASES = [("llama", 64, 160, 96), ("llama", 96, 256, 200), ("gpt", 64, None, 48), ("gpt", 32, None, 130)]


def _step(block, x0, kwargs, variant):
    """(forward peak, backward peak, gradients) of a step of ``block`` under ``variant``, in bytes
    the step created (the third call: gradaccel's planned one)."""
    for _ in range(3):
        torch.manual_seed(5)  # dropout draws alike in every variant
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        live = LiveBytes()
        with live:
            live.set_phase("fwd")
            if variant == "stock":
                y = block(x, **kwargs)
            elif variant == "torch":
                y = tc.checkpoint(block, x, use_reentrant=False, **kwargs)
            else:
                y = gradaccel.checkpoint(block, x, budget=variant, **kwargs)
            loss = y.square().sum()
            del y
            live.set_phase("bwd")
            loss.backward()
            del loss
    grads = [x.grad] + [p.grad for p in block.parameters() if p.grad is not None]
    return live.phases["fwd"][1], live.phases["bwd"][1], grads


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[3]}" for c in CASES])
def test_keep_least_replay_peaks_at_most_as_torch_checkpoint(case, lora):
    reset_plans()
    name, hidden, inter, tokens = case
    block, x, kwargs = _llama(hidden, inter, tokens, lora) if name == "llama" else _gpt(hidden, tokens, lora)
    _, _, stock = _step(block, x, kwargs, "stock")
    torch_fwd, torch_bwd, torch_grads = _step(block, x, kwargs, "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # budget=1 is an int: 1 byte, as meant
        fwd, bwd, grads = _step(block, x, kwargs, 1)  # keep-least: budget=0 is torch's own checkpoint
        _, part_bwd, part_grads = _step(block, x, kwargs, 0.25)
    assert fwd <= torch_fwd and bwd <= torch_bwd, (fwd, torch_fwd, bwd, torch_bwd)
    # A plan that keeps some gets the same (it held up to 1.4x torch's before the replay freed).
    assert part_bwd <= torch_bwd, (part_bwd, torch_bwd)
    for got in (grads, part_grads, torch_grads):
        for g, e in zip(got, stock):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6 * (e.abs().max().item() or 1.0))


@pytest.mark.parametrize("budget", [1, 0.3, 0.6])
def test_the_plans_sweep_is_the_replays_measured_peak(budget, monkeypatch):
    reset_plans()
    block, x0, kwargs = _gpt(64, 40, lora=True)
    seen = []
    real = Plan.replay

    def measured(self, leaves, rng, packs=None):
        with LiveBytes() as live:
            out = real(self, leaves, rng, packs)
        seen.append((self, live.peak, live.live))
        return out

    monkeypatch.setattr(Plan, "replay", measured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            x = x0.clone().requires_grad_()
            gradaccel.checkpoint(block, x, budget=budget).square().sum().backward()
    (plan, peak, held), *_ = seen[-1:]
    assert plan.steps and peak == plan.replay_peak and held == plan.replay_held
    made = sum(plan.graph.storages[s].nbytes for i in plan.steps for s, _ in plan.graph.ops[i].new_storages)
    assert plan.replay_held <= plan.replay_peak < made  # it no longer holds all it makes
    (row,) = plan_rows()
    assert row["replay_peak_bytes"] == plan.replay_peak
