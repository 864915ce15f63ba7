"""fuse_wgrad with head mode's chunked loss (gradaccel/memory/chunked_loss.py): each chunk's
``dyᵀ·h`` goes straight into the LM head weight's fp32 window slice, through the sink of the
routed head (gradaccel/accumulate/wgrad.py: sink_of). Against stock big-batch training (fp32,
tight tolerance), with the head tied to the embedding or not, whichever of head mode and the
optimizer comes first; and no head-weight-sized gradient tensor is made in backward."""

import copy

import pytest
import torch

from gradaccel import FusedAccumOptimizer
from gradaccel.accumulate.wgrad import sink_of
from gradaccel.memory import chunked_loss
from gradaccel.memory.counter import StorageLog
from gradaccel.memory.chunked_loss import HeadLogits, install_head, set_head

transformers = pytest.importorskip("transformers")

V, C, T, MICRO = 1000, 32, 40, 3


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_loss, "chunk_rows", lambda rows, vocab: 16)  # several chunks a micro-batch


def llama(tied):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=C, intermediate_size=2 * C, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=V,
                                   max_position_embeddings=128, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).train()


def micro_batches(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(MICRO):
        ids = torch.randint(0, V, (1, T), generator=g)
        labels = ids.clone()
        labels[0, : 3 + 4 * k] = -100  # each micro-batch counts another number of tokens
        out.append((ids, labels))
    return out


def fused_head_model(tied, head_first):
    """A head-mode model and its fuse_wgrad optimizer, set up in either order."""
    model = llama(tied)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    if head_first:
        assert install_head(model)
        opt = FusedAccumOptimizer(inner, 1, normalize="sum", fuse_wgrad=True, module=model)
    else:
        opt = FusedAccumOptimizer(inner, 1, normalize="sum", fuse_wgrad=True, module=model)
        assert install_head(model)
    set_head(model, True)
    assert "lm_head" in opt.fused_layers and sink_of(model.lm_head) is not None
    return model, opt


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("head_first", [True, False])
def test_training_equals_big_batch(tied, head_first):
    """Three micro-batches a window, each loss summed over its tokens and divided by the
    window's token count (num_items_in_batch, as HF Trainer does): the window gradient is the
    big batch's, and three windows of SGD land where stock big-batch training does."""
    ref = llama(tied)
    model, opt = fused_head_model(tied, head_first)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for window in range(3):
        batches = micro_batches(window)
        items = sum(int((lab[:, 1:] != -100).sum()) for _, lab in batches)
        for ids, labels in batches:
            out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items), use_cache=False)
            assert isinstance(out.logits, HeadLogits)
            out.loss.backward()
        assert model.lm_head.weight.grad is None  # never made: it went into the window
        opt.step()
        opt.zero_grad()
        big_ids = torch.cat([i for i, _ in batches])
        big_labels = torch.cat([lab for _, lab in batches])
        ref(input_ids=big_ids, labels=big_labels, use_cache=False).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"window {window}: {name}")




@pytest.mark.parametrize("tied", [False, True])
def test_no_head_sized_gradient_in_backward(tied):
    """With the fold, backward makes the head's (and the embedding's) V x C gradient; with
    fuse_wgrad nothing that large exists in backward (every storage made, exact bytes)."""
    weight_bytes = V * C * 4
    ids, labels = micro_batches(0)[0]
    largest = {}
    for fused in (False, True):
        if fused:
            model, opt = fused_head_model(tied, True)
        else:
            model = llama(tied)
            install_head(model)
            set_head(model, True)
            opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), 1)
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        with StorageLog() as mode:
            loss.backward()
        largest[fused] = mode.largest
        opt.step()
    assert largest[False] >= weight_bytes  # the fold's autograd makes it: the check can fail
    assert largest[True] == 16 * V * 4 < weight_bytes, largest  # the largest: a chunk's fp32 logits (16 x V)
