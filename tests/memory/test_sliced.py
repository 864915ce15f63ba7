"""Sliced plans (gradaccel/memory/sliced.py): a decoder block a slice of the sequence at a time,
keys and values whole. Attention over the lower-right causal band against a masked reference;
the block's gradients against stock PyTorch's (Llama, Qwen3, Mistral; peft LoRA; a padding
mask); the generator replayed for dropout; which blocks run sliced."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from gradaccel.memory import sliced as sliced_mod  # noqa: E402
from gradaccel.memory.sliced import attend, set_sliced, why_not  # noqa: E402


def _reference(q, k, v, start, scale):
    """Lower-right causal attention the plain way: K/V repeated per query head, a dense mask."""
    rep = q.shape[1] // k.shape[1]
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(diagonal=start)
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                          v.float().repeat_interleave(rep, 1), attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("start,rows", [(0, 17), (5, 1), (40, 24), (63, 65)])
def test_attend_matches_a_masked_reference(dtype, tol, start, rows):
    g = torch.Generator().manual_seed(start + rows)
    q = torch.randn(2, 8, rows, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 2, start + rows, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 2, start + rows, 16, generator=g).to(dtype).requires_grad_()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, ref = attend(q, k, v, start, 0.3), _reference(*ref_in, start, 0.3)
    dout = torch.randn(ref.shape, generator=g)
    out.backward(dout.to(dtype))
    ref.backward(dout)
    assert out.dtype == dtype
    for got, want in [(out, ref)] + [(t.grad, r.grad) for t, r in zip((q, k, v), ref_in)]:
        assert (got.float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def _config(kind, layers=2):
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=512)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    return transformers.LlamaConfig(**common)


def _model(kind, lora_dropout=None):
    torch.manual_seed(0)
    config = _config(kind)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if lora_dropout is not None:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout,
                                                 target_modules="all-linear", init_lora_weights=False))
    return model


def _layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _close(got, want, rel=1e-5):
    worst = max(g.abs().max().item() for g in want.values())
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max().item() <= rel * worst, name


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("slices", [1, 3, 8])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "peft-lora"])
def test_sliced_gradients_equal_stock(kind, slices, lora):
    """Every block sliced: the loss and the gradients of every trainable parameter are stock's
    (fp32; the sums over slices change the order of additions only). 67 tokens, batch 2: the
    last slice is shorter."""
    ids = torch.randint(0, 96, (2, 67), generator=torch.Generator().manual_seed(5))
    ref = _model(kind, 0.0 if lora else None)
    want_loss = ref(input_ids=ids, labels=ids).loss
    want_loss.backward()
    model = _model(kind, 0.0 if lora else None)
    for layer in _layers(model):
        assert why_not(layer) is None
        set_sliced(layer, slices)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    _close(_grads(model), _grads(ref))


def test_sliced_with_a_padding_mask_equals_stock():
    """Padded batches: the model's own mask, cut to each slice's rows, is what attention uses."""
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding, as generation-style collators pad
    labels = ids.masked_fill(mask == 0, -100)
    ref = _model("llama")
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    model = _model("llama")
    for layer in _layers(model):
        set_sliced(layer, 4)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    _close(_grads(model), _grads(ref))


def test_sliced_replays_the_generator(monkeypatch):
    """With LoRA dropout, the backward rebuilds each slice with the generator states its forward
    used: the gradients equal those of the same sliced forward differentiated directly."""
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(7))

    def run(direct):
        model = _model("llama", lora_dropout=0.5)
        for layer in _layers(model):
            set_sliced(layer, 3)
        if direct:  # the slices with grad, in the forward's order, no node and no rebuild
            def apply(run, x, *params):
                kv = [run.kv(x[:, s:e], j) for j, (s, e) in enumerate(run.bounds)]
                k, v = (torch.cat(t, 2) for t in zip(*kv))
                return torch.cat([run.rows(x[:, s:e], k[:, :, :e], v[:, :, :e], i)
                                  for i, (s, e) in enumerate(run.bounds)], 1)
            monkeypatch.setattr(sliced_mod._SlicedBlock, "apply", apply)
        torch.manual_seed(11)
        model(input_ids=ids, labels=ids).loss.backward()
        monkeypatch.undo()
        return _grads(model)

    _close(run(False), run(True))


def test_sliced_is_stock_outside_training():
    """Eval and no_grad run the model's own forward: the same logits, nothing sliced."""
    ids = torch.randint(0, 96, (1, 30))
    ref, model = _model("llama"), _model("llama")
    for layer in _layers(model):
        set_sliced(layer, 4)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_which_blocks_run_sliced():
    llama = transformers.LlamaForCausalLM(_config("llama"))
    assert why_not(llama.model.layers[0]) is None
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, sliding_window=32))
    assert "sliding window of 32" in why_not(windowed.model.layers[0])
    phi = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=64, pad_token_id=0))
    assert "Phi3DecoderLayer is not a decoder layer" in why_not(phi.model.layers[0])
    cfg = _config("llama")
    cfg.attention_dropout = 0.1
    assert "attention dropout" in why_not(transformers.LlamaForCausalLM(cfg).model.layers[0])
