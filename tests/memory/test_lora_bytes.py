"""fit's LoRA layer against real peft layers: the same tensors at the same dtypes, and the same
bytes (held for backward, and at the peak of forward and backward), over ``nn.Linear`` and over
bitsandbytes ``Linear4bit``, with and without bf16 autocast, on CPU."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from gradaccel.memory import LiveBytes
from gradaccel.memory.fixed_parts import LoRALinear
from gradaccel.recompute.block_plan import BlockPlan, set_plan
from tests._ops import OpLog

peft = pytest.importorskip("peft")

IN, OUT, R = 64, 96, 4


def _outputs(func, args, kwargs, out):
    """Each op's outputs as (op, dtype, shape)."""
    return [(func.overloadpacket.__name__, t.dtype, tuple(t.shape)) for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)]


class _Holder(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.proj = base

    def forward(self, x):
        return self.proj(x)


def _peft_layer(quantized):
    """A peft LoRA layer as ``get_peft_model`` makes it (adapters cast to fp32), and its base's
    weight as a dense bf16 matrix (dequantised where 4-bit)."""
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    holder = _Holder(dense)
    if quantized:
        bnb = pytest.importorskip("bitsandbytes")
        q = bnb.nn.Linear4bit(IN, OUT, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True)
        q.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True)
        holder.proj = q.to("cpu")
        holder.is_loaded_in_4bit = True  # what peft reads to dispatch to its bnb layer
        dense.weight.data = bnb.functional.dequantize_4bit(holder.proj.weight.data, holder.proj.weight.quant_state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(holder, peft.LoraConfig(r=R, lora_alpha=2 * R, target_modules=["proj"]))
    layer = model.base_model.model.proj
    assert type(layer).__name__ == ("Linear4bit" if quantized else "Linear")
    nn.init.normal_(layer.lora_B["default"].weight)  # peft starts B at zero: make the adapter count
    return layer, dense


def _fit_layer(real, dense, quantized):
    layer = LoRALinear(dense, R, quantized=quantized)
    with torch.no_grad():
        layer.lora_A.weight.copy_(real.lora_A["default"].weight)
        layer.lora_B.weight.copy_(real.lora_B["default"].weight)
    layer.scaling = real.scaling["default"]
    return layer


def _run(layer, x, autocast):
    """(adapter's ops in forward, bytes held after forward, peak of forward and backward, peak of
    a forward that saves nothing (as a keep-nothing checkpoint's), output, input gradient)."""
    x = x.detach().requires_grad_(True)
    ops, live = OpLog(_outputs), LiveBytes()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), live, ops:
        y = layer(x)
        held, forward_ops = live.live, list(ops.ops)
        y.float().square().sum().backward()
    bare = LiveBytes()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad(), bare:
        layer(x)
    return forward_ops, held, live.peak, bare.peak, y.detach(), x.grad


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_fit_lora_makes_the_tensors_peft_makes(quantized, autocast):
    real, dense = _peft_layer(quantized)
    assert real.lora_A["default"].weight.dtype == torch.float32  # get_peft_model's autocast_adapter_dtype
    mine = _fit_layer(real, dense, quantized)
    x = torch.randn(3, 17, IN, dtype=torch.bfloat16)
    real_ops, real_held, real_peak, real_bare, real_y, real_gx = _run(real, x, autocast)
    fit_ops, fit_held, fit_peak, fit_bare, fit_y, fit_gx = _run(mine, x, autocast)
    # The base's own ops differ (bitsandbytes' gemm_4bit, one matmul for nn.Linear); from the
    # base's output on, the same tensors at the same dtypes and shapes, in the same order.
    def adapter(ops):
        i = next(k for k, (_, dtype, shape) in enumerate(ops) if shape == (3, 17, OUT))
        return [(dtype, shape) for _, dtype, shape in ops[i:]]
    assert adapter(fit_ops) == adapter(real_ops)
    assert any(dtype == torch.float32 and shape[-1] == OUT for dtype, shape in adapter(real_ops)) != autocast or \
        quantized  # the full-width fp32 tensors exist without autocast (and with it, nowhere)
    # Byte for byte: held for backward and the peak (the base's gemm_4bit holds what mm holds).
    assert (fit_held, fit_peak, fit_bare) == (real_held, real_peak, real_bare)
    # And the same function (4-bit: against the dequantised weight, which gemm_4bit rounds apart).
    tol = dict(rtol=2e-2, atol=2e-2) if quantized else dict(rtol=0, atol=0)
    torch.testing.assert_close(fit_y, real_y, **tol)
    torch.testing.assert_close(fit_gx, real_gx, **tol)


def test_fit_predicts_a_peft_model_from_its_config():
    """fit's model built from a config (its LoRA layers, not peft's) against the real peft model
    of that config (bf16 weights, fp32 adapters on every linear layer, CPU): every phase of the
    step's profile equals, to the byte, the profile of the peft model itself copied onto fake
    tensors; and the predicted step peak is near the real peak of live bytes."""
    transformers = pytest.importorskip("transformers")
    import gradaccel
    from gradaccel.memory.counter import measured_peak
    from gradaccel.memory.fit import Planner, find_blocks, hf_step

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    gradaccel.reset_plans()
    torch.manual_seed(0)
    # As a model loads with dtype=bfloat16 (the rotary frequencies stay fp32), and as fit builds it.
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=2 * R, target_modules="all-linear"))
        gradaccel.checkpoint_blocks(model, budget=1)  # one byte, as Fit.apply sets per block
    model.train()
    seq = 80
    mine, theirs = Planner(cfg, lora=R, optim="sgd", dtype=torch.bfloat16), Planner(model, optim="sgd")
    assert mine.static == theirs.static
    assert mine.profile(seq, 1).phases == theirs.profile(seq, 1).phases
    opt = gradaccel.FusedAccumOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3), 1)
    ids = torch.randint(0, 128, (1, seq))
    prof = mine.profile(seq, 1)
    for frac in (0.0, 1.0):
        budgets = [max(1, int(frac * prof.kind_of[s].graph.activation_bytes)) for s in mine.layout]
        predicted = mine.estimate(seq, 1, budgets).peak
        assert predicted == theirs.estimate(seq, 1, budgets).peak
        for block, b in zip(find_blocks(model), budgets):
            set_plan(block, BlockPlan.parse(b))
        real = measured_peak(model, opt, hf_step, {"input_ids": ids, "labels": ids})
        # Not LoRA's: both profiles agree; bf16 on CPU, fake and real tensors differ by 2.4% here
        # (fp32 models match within 1%: tests/memory/test_fit.py).
        assert abs(predicted / real - 1) < 0.05, (frac, predicted, real)
