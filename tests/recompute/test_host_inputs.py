"""Block inputs parked in host memory (checkpoint_blocks(..., inputs_on_host=True)): gradients equal
keeping them on the device (bit for bit on CPU: the same kernels run), their bytes leave the
device count, and backward brings them back one block ahead."""

import copy

import pytest
import torch
from torch import nn

import gradaccel
from gradaccel.memory import LiveBytes
from gradaccel.recompute import host_inputs
from gradaccel.recompute.blocks import release
from tests._models import PlainBlock

WIDTH, T, LAYERS = 64, 256, 4  # a block input: T * WIDTH * 4 = 64 KiB, just worth parking


class Stack(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.blocks = nn.ModuleList(PlainBlock(WIDTH, 4) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _grads(model, x):
    x = x.clone().requires_grad_()
    model(x).square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("budget", [None, 0.5])
def test_grads_bit_equal_to_kept_inputs(budget):
    torch.manual_seed(0)
    base, x = Stack(), torch.randn(1, T, WIDTH)
    kept = gradaccel.checkpoint_blocks(copy.deepcopy(base), budget=budget)
    parked = gradaccel.checkpoint_blocks(copy.deepcopy(base), budget=budget, inputs_on_host=True)
    for step in range(2):  # the first call of a budget traces, the second runs the plan
        for a, b in zip(_grads(kept, x), _grads(parked, x)):
            assert torch.equal(a, b)
        for m in (kept, parked):
            m.zero_grad()


def _held_after_forward(model, x0):
    live = LiveBytes()
    with live:
        x = x0 * 1.0  # the first block's input is made in the step (an embedding's output), and counted
        out = model(x)
        del x
        held = live.live - out.untyped_storage().nbytes()
        out.sum().backward()
    return held, live.peak


def test_inputs_leave_the_device_count():
    torch.manual_seed(0)
    base, x = Stack(8), torch.randn(1, 4 * T, WIDTH, requires_grad=True)
    base.requires_grad_(False)  # frozen weights (as under LoRA): the peak is activations, not grads
    kept = gradaccel.checkpoint_blocks(copy.deepcopy(base))
    parked = gradaccel.checkpoint_blocks(copy.deepcopy(base), inputs_on_host=True)
    store = gradaccel.recompute.offload_frame.store_for(None)
    held_kept, peak_kept = _held_after_forward(kept, x)
    before = store.bytes_in_use
    held_parked, peak_parked = _held_after_forward(parked, x)
    one = 4 * T * WIDTH * 4
    assert held_kept == 8 * one  # every block's input
    assert held_parked == 0  # none: all on the host
    # The step peaks in the backward of a block before the last (its replay, the gradient
    # flowing in): kept, it holds its own input and those of all blocks before it (7); parked,
    # only its own and the one before it, prefetched (2). Same kernels: exact bytes.
    assert peak_kept - peak_parked == 5 * one
    assert store.bytes_in_use == before  # every host buffer was given back after backward


def test_host_holds_the_inputs_between_forward_and_backward():
    torch.manual_seed(0)
    model = gradaccel.checkpoint_blocks(Stack(), inputs_on_host=True)
    store = gradaccel.recompute.offload_frame.store_for(None)
    before = store.bytes_in_use
    out = model(torch.randn(1, T, WIDTH, requires_grad=True) * 1.0)  # not a leaf: parked too
    assert store.bytes_in_use - before == LAYERS * T * WIDTH * 4
    out.sum().backward()
    assert store.bytes_in_use == before


def test_prefetch_runs_one_block_ahead(monkeypatch):
    order, parked = [], []
    real = host_inputs._Parked.__init__

    def spy(self, *a):
        real(self, *a)
        parked.append(id(self))

    monkeypatch.setattr(host_inputs._Parked, "__init__", spy)
    model = Stack()
    x = torch.randn(1, T, WIDTH, requires_grad=True) * 1.0
    for b in model.blocks:
        x = host_inputs.run_parked(lambda y, b=b: torch.utils.checkpoint.checkpoint(b, y, use_reentrant=False),
                                   (x,), order=order)
    x.sum().backward()
    # Backward meets the blocks last to first: each restore is followed by the prefetch of the
    # block before it, and that block's restore finds it staged.
    expect = []
    for i in reversed(range(LAYERS)):
        expect.append(("restore", parked[i]))
        if i:
            expect.append(("prefetch", parked[i - 1]))
    assert order == expect


def test_small_or_aliased_inputs_stay():
    calls = []
    tiny = torch.randn(4, 4, requires_grad=True)
    out = host_inputs.run_parked(lambda y: calls.append(y) or y * 2, (tiny,))
    assert calls[0] is tiny and out.grad_fn is not None  # under MIN_BYTES: not even copied
    big = torch.randn(T, WIDTH, requires_grad=True) * 1.0
    out = host_inputs.run_parked(lambda y: y.view(-1), (big,))
    assert out.untyped_storage().nbytes() == big.numel() * 4  # handed back: still on the device
    # A leaf that requires grad: its gradient accumulator holds it anyway, so no copy is made.
    leaf = torch.randn(T, WIDTH, requires_grad=True)
    host_inputs.run_parked(lambda y: calls.append(y) or y * 2, (leaf,))
    assert calls[-1] is leaf


def test_hf_llama_with_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (1, 300))

    def grads(m):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in m.parameters()]

    kept = copy.deepcopy(base)
    kept.gradient_checkpointing_enable()  # HF's hook with torch's checkpoint
    parked = copy.deepcopy(base)
    parked.gradient_checkpointing_enable()
    gradaccel.checkpoint_blocks(parked, inputs_on_host=True)  # takes over HF's hook
    store = gradaccel.recompute.offload_frame.store_for(None)
    calls = []
    real = host_inputs._Parked.restore
    host_inputs._Parked.restore = lambda self, *a: calls.append(1) or real(self)
    try:
        for a, b in zip(grads(kept), grads(parked)):
            assert torch.equal(a, b)
    finally:
        host_inputs._Parked.restore = real
    assert len(calls) == cfg.num_hidden_layers
    assert "inputs_on_host=True" in repr(parked.model.layers[0]._gradient_checkpointing_func)
    release(parked)


def test_bad_flag():
    with pytest.raises(TypeError, match="inputs_on_host"):
        gradaccel.checkpoint_blocks(Stack(), inputs_on_host="yes")
