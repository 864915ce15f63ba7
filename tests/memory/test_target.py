"""checkpoint_blocks(memory=...) below the per-block floor (gradaccel/memory/target.py), against stock PyTorch."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import gradaccel
from gradaccel.memory.chunked_loss import ChunkedLinearCrossEntropy
from gradaccel.memory.target import MemoryTarget
from gradaccel.memory.counter import LiveBytes

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("bias,num_items", [(False, None), (True, 7)])
def test_chunked_linear_cross_entropy_matches_torch(bias, num_items):
    torch.manual_seed(0)
    n, c, v = 37, 16, 50  # 37 rows in chunks of 8: a short last chunk
    h = torch.randn(n, c, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, c, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, v, (n,))
    y[::5] = -100  # ignored rows
    g = torch.tensor(1.7, dtype=torch.float64)

    logits = F.linear(h, w, b)
    ref = F.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum") / (num_items or (y != -100).sum())
    (ref * g).backward()
    want = [t.grad.clone() for t in (h, w, b) if t is not None]
    for t in (h, w, b):
        if t is not None:
            t.grad = None
    denom = num_items if num_items is not None else (y != -100).sum()
    for given in (logits.detach(), None):  # logits the model made already, or made a chunk at a time
        got = ChunkedLinearCrossEntropy.apply(h, w, b, given, y, denom, -100, 8)
        (got * g).backward()
        # float32 loss maths on float64 inputs (as ForCausalLMLoss upcasts): float32 tolerance.
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        for t, ref_grad in zip([t for t in (h, w, b) if t is not None], want):
            torch.testing.assert_close(t.grad, ref_grad, rtol=1e-5, atol=1e-6)
            t.grad = None


def _llama(hidden, vocab, layers=1):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).train()


def _step_peak(model, ids):
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return live.peak, loss.detach()


@pytest.mark.parametrize("hidden,vocab,seq,mode", [(32, 1024, 64, "head"), (64, 64, 128, "parts")])
def test_memory_below_per_block_floor(hidden, vocab, seq, mode):
    """A target under what per-block plans reach: the step's measured peak stays under it and
    gradients are those without checkpointing."""
    gradaccel.reset_plans()
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    ref = _llama(hidden, vocab)
    ref_peak, ref_loss = _step_peak(ref, ids)

    # The least the plans reach (memory=1 byte: warned about, lowest-peak plan taken).
    probe = gradaccel.checkpoint_blocks(_llama(hidden, vocab), memory=1)
    with pytest.warns(UserWarning, match="below the least"):
        probe(input_ids=ids, labels=ids, use_cache=False)
    target = next(h for h in probe._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    (least_mode, least, floor), = target.chosen.values()
    assert mode in least_mode, least_mode
    assert least < floor  # below the per-block floor
    assert least < 0.9 * ref_peak

    memory = (least + floor) // 2
    model = gradaccel.checkpoint_blocks(_llama(hidden, vocab), memory=memory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="budget=1 is an int")
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # chooses, plans
        peak, loss = _step_peak(model, ids)
    target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    (chosen, _, _), = target.chosen.values()
    assert chosen != "blocks"  # below the floor: not per-block plans
    assert peak <= memory, (peak, memory)
    assert "_gradaccel_made" not in model.lm_head.__dict__  # nothing of the head outlives the step
    # Same maths; the chunked loss sums in another order: a tolerance.
    torch.testing.assert_close(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
