"""Head mode (gradaccel/memory/chunked_loss.py): the causal-LM loss a chunk of rows at a time
without the whole logits, through a tiny Hugging Face Llama's real forward, against the stock
model (its ``lm_head`` logits and ``ForCausalLMLoss``)."""

import copy

import pytest
import torch
import torch.nn as nn

from gradaccel.memory import chunked_loss
from gradaccel.memory.counter import StorageLog
from gradaccel.memory.chunked_loss import HeadLogits, HeadLogitsError, install_head, set_head

transformers = pytest.importorskip("transformers")

V, C, B, T = 1000, 32, 2, 48
CHUNK = 16  # rows per chunk in these tests: several chunks, and a short last one (B * T = 96)


def llama(bias=False, tied=False, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=C, intermediate_size=2 * C, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=V,
                                   max_position_embeddings=128, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    if bias:
        model.lm_head = nn.Linear(C, V, bias=True)
        torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    return model.to(dtype).train()


def headed(model):
    m = copy.deepcopy(model)
    assert install_head(m)
    set_head(m, True)
    return m


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :7] = -100  # a prompt that does not count
    labels[1, 30:] = -100  # padding
    return ids, labels


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_loss, "chunk_rows", lambda rows, vocab: CHUNK)




def _grads_and_hidden(model, ids, labels, **kw):
    seen = {}
    handle = model.model.norm.register_forward_hook(lambda m, a, out: seen.setdefault("h", out).retain_grad())
    out = model(input_ids=ids, labels=labels, use_cache=False, **kw)
    out.loss.backward()
    handle.remove()
    return out, {n: p.grad for n, p in model.named_parameters()}, seen["h"].grad


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 77])
@pytest.mark.parametrize("chunk", [CHUNK, B * T])  # several chunks (fp32 head-gradient sums), or one
def test_loss_and_gradients_equal_stock(bias, num_items, chunk, monkeypatch):
    monkeypatch.setattr(chunked_loss, "chunk_rows", lambda rows, vocab: chunk)
    ref = llama(bias=bias)
    model = headed(ref)
    ids, labels = batch()
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want, want_grads, want_h = _grads_and_hidden(ref, ids, labels, **kw)
    got, got_grads, got_h = _grads_and_hidden(model, ids, labels, **kw)
    assert isinstance(got.logits, HeadLogits) and not isinstance(want.logits, HeadLogits)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-7)  # the hidden states' gradient
    assert want_grads.keys() == got_grads.keys() and ("lm_head.bias" in got_grads) == bias
    for name in want_grads:  # the head's weight and bias, and everything below them
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_under_autocast():
    """An fp32 model under bf16 autocast: the chunks' matmuls run in bf16 in forward and backward
    alike, as the stock head's would."""
    ref = llama()
    model = headed(ref)
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads, _ = _grads_and_hidden(ref, ids, labels)
        got, got_grads, _ = _grads_and_hidden(model, ids, labels)
    assert got.logits.dtype == want.logits.dtype == torch.bfloat16
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-3, atol=2e-3)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=2e-2, atol=2e-3, msg=name)


def test_no_logits_sized_tensor_exists():
    """No tensor with the logits' bytes is made in forward or backward (exact bytes of every
    storage made). The stock model makes the whole fp32 logits (the check can fail)."""
    ids, labels = batch()
    logits_bytes = B * T * V * 4
    sizes = {}
    for name, model in (("stock", llama()), ("head", headed(llama()))):
        with StorageLog() as mode:
            out = model(input_ids=ids, labels=labels, use_cache=False)
            out.loss.backward()
        sizes[name] = mode.largest
        if name == "head":
            assert out.logits.untyped_storage().nbytes() == 0  # the stand-in costs nothing
    assert sizes["stock"] >= logits_bytes
    # A chunk's fp32 logits (1/6 of the whole), or the weights' gradients (the head's and the
    # embedding's, V x C: without fuse_wgrad, autograd makes them; tests/accumulate/test_wgrad_head.py).
    assert sizes["head"] == max(CHUNK * V * 4, V * C * 4) < logits_bytes / 2, sizes


def test_eval_no_grad_and_no_labels_return_real_logits():
    ref = llama()
    model = headed(ref)
    ids, labels = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
        got = model(input_ids=ids, labels=labels, use_cache=False)  # no grad: real logits
        assert type(got.logits) is torch.Tensor
        torch.testing.assert_close(got.logits, want)
    model.eval()
    out = model(input_ids=ids, labels=labels, use_cache=False)  # eval with grad: real logits
    assert type(out.logits) is torch.Tensor
    torch.testing.assert_close(out.logits, want)
    model.train()
    out = model(input_ids=ids, use_cache=False)  # a loss computed outside the model: real logits
    assert type(out.logits) is torch.Tensor and out.logits.requires_grad
    torch.testing.assert_close(out.logits, want)
    set_head(model, False)  # head mode off: the model's own loss and logits
    out = model(input_ids=ids, labels=labels, use_cache=False)
    assert type(out.logits) is torch.Tensor
    assert "_gradaccel_made" not in model.lm_head.__dict__


def test_reading_the_stand_in_raises():
    model = headed(llama())
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels, use_cache=False)
    logits = out.logits
    assert logits.shape == (B, T, V) and logits.dtype == torch.float32
    assert logits.take_source() is None  # the loss took the hidden states; nothing is held
    # What accelerate and DDP do to a model's outputs (fp32 conversion, clone) reads no values.
    for same in (logits.float(), logits.to(torch.bfloat16), logits.detach(), logits.clone()):
        assert isinstance(same, HeadLogits) and same.shape == logits.shape
    assert "not made" in repr(logits) and "not made" in repr(out)
    for read in (lambda: logits.argmax(-1), lambda: logits[..., :-1, :], lambda: logits.sum().item(),
                 lambda: torch.softmax(logits, -1), lambda: logits + 1, lambda: logits.tolist(),
                 lambda: logits.numpy(), lambda: logits.float().view(-1, V)):
        with pytest.raises(HeadLogitsError, match=r"head mode.*set_head\(model, False\)"):
            read()


def test_trl_fused_head_metrics_are_right_in_head_mode():
    """TRL's SFTTrainer (1.x) computes its loss, token accuracy and entropy through its own
    fused head (``fused_lm_head=True``), which reads ``lm_head.weight``, never calls the head
    module and never the model's loss: on a head-mode model they are the stock model's."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this trl has no fused LM head (it reads outputs.logits: head mode raises there)")
    ref = llama()
    model = headed(ref)
    ids, labels = batch()
    outs = []
    for m in (ref, model):
        trl_utils.add_fused_lm_head(m, outputs=("log_probs", "entropy", "is_top1"))
        out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        out.loss.backward()
        outs.append(out)
    for field in ("loss", "entropy", "is_top1", "log_probs"):
        torch.testing.assert_close(getattr(outs[1], field), getattr(outs[0], field), msg=field)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_models_that_change_their_logits_have_no_head_mode():
    """Gemma 2 soft-caps its logits between the head and the loss: no stand-in may reach that."""
    cfg = transformers.Gemma2Config(hidden_size=C, intermediate_size=2 * C, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=V)
    assert not install_head(transformers.Gemma2ForCausalLM(cfg))
    assert install_head(llama())
