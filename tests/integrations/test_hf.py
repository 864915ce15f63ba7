"""checkpoint_blocks on small random Hugging Face models, compared with the same model unchanged."""

import copy
import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _models import assert_grads_match  # noqa: E402,F401  (test_hf_takeover imports it from here too)
from gradaccel import checkpoint_blocks  # noqa: E402
from gradaccel.recompute.checkpoint import plan_rows, reset_plans  # noqa: E402

VOCAB, SEQ = 64, 9


def _config(arch, dropout):
    if arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=dropout, pad_token_id=0)
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_pair(arch, attn, dropout=0.0):
    """The reference model and an identical copy (same weights) to be checkpointed."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(arch, dropout), attn_implementation=attn)
    return ref, copy.deepcopy(ref)


def _mlp_input_module(model):
    # The first projection of each block's MLP: its output is saved by the activation after it.
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    return [layer.mlp.gate_proj if hasattr(layer.mlp, "gate_proj") else layer.mlp.c_fc for layer in layers]


def lm_loss(model, ids, seed=1):
    torch.manual_seed(seed)
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def assert_same_step(ref, model, ids, seed=1):
    """One training step of each gives the same loss, bit for bit, and matching gradients."""
    a, b = lm_loss(ref, ids, seed), lm_loss(model, ids, seed)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    a.backward(), b.backward()
    assert_grads_match(ref, model)


ARCHS = ["llama", "gpt2"]
ATTNS = ["eager", "sdpa"]


@pytest.mark.parametrize("budget", [None, 0.0, 0.5, 1.0])
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_grads_match(arch, attn, budget):
    # Dropout on: the recompute must replay the forward's random numbers.
    reset_plans()  # only this model's regions in plan_rows() below (earlier models may await gc)
    ref, model = make_pair(arch, attn, dropout=0.1)
    checkpoint_blocks(model, budget=budget)
    ref.train(), model.train()
    for seed in (1, 2):  # a second step on the same shapes, after any planning
        ids = torch.randint(1, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed))
        ref.zero_grad(), model.zero_grad()
        assert_same_step(ref, model, ids, seed)
    if budget:  # one plan per block, traced once and then reused: nothing in the signature moves
        assert [r["calls"] for r in plan_rows()] == [2, 2]


@pytest.mark.parametrize("arch", ARCHS)
def test_uses_the_hf_hook(arch):
    ref, model = make_pair(arch, "sdpa")
    checkpoint_blocks(model, budget=0.5)
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]
    assert len(layers) == 2
    for layer in layers:
        assert layer.gradient_checkpointing is True
        assert layer._gradient_checkpointing_func.budget == 0.5
    assert model.is_activation_checkpointing
    assert getattr(model, "_require_grads_hooks", None), "enable_input_require_grads() was not called"
    assert list(model.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("budget", [0.0, 1.0])
@pytest.mark.parametrize("arch", ARCHS)
def test_budget_reaches_the_blocks(arch, budget):
    # Through HF's hook too: budget 0 frees the MLP's intermediate after the forward; 1.0 keeps
    # it once planned (the first call runs as a full recompute).
    ref, model = make_pair(arch, "eager")
    checkpoint_blocks(model, budget=budget)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    for step in range(2):
        for m, expect in ((ref, True), (model, budget == 1.0 and step == 1)):
            kept = []
            handles = [mod.register_forward_hook(lambda _m, _a, out: kept.append(weakref.ref(out.untyped_storage())))
                       for mod in _mlp_input_module(m)]
            loss = lm_loss(m, ids)
            gc.collect()
            assert [r() is not None for r in kept[:2]] == [expect] * 2, (step, m is ref)
            loss.backward()
            for h in handles:
                h.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_eval_train_and_generate_keep_working(arch):
    ref, model = make_pair(arch, "sdpa", dropout=0.1)
    checkpoint_blocks(model)
    ids = torch.randint(1, VOCAB, (2, 5))
    mask = torch.ones_like(ids)
    for mode in ("eval", "train"):  # generate() in train mode runs under no_grad: no checkpointing
        getattr(ref, mode)(), getattr(model, mode)()
        outs = []
        for m in (ref, model):
            torch.manual_seed(4)
            outs.append(m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0))
        assert outs[1].shape == (2, 9)
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    ref.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    # Back to training after eval: still checkpointed and still exact.
    ref.train(), model.train()
    assert_same_step(ref, model, ids)


def test_deleted_model_is_freed():
    # Plans must not keep a model alive after the user drops it.
    _, model = make_pair("llama", "eager")
    checkpoint_blocks(model, budget=0.5)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    for _ in range(2):
        lm_loss(model, ids).backward()
    layer = weakref.ref(model.model.layers[0])
    del model
    gc.collect()
    assert layer() is None


def test_frozen_embeddings_still_train_blocks():
    # Adapter-style fine-tuning: embeddings frozen, blocks trained through the checkpoint.
    ref, model = make_pair("llama", "sdpa")
    checkpoint_blocks(model, budget=0.0)
    for m in (ref, model):
        m.get_input_embeddings().weight.requires_grad_(False)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    a, b = lm_loss(ref, ids), lm_loss(model, ids)
    a.backward(), b.backward()
    assert_grads_match(*(
        torch.nn.ParameterList([p for p in m.parameters() if p.requires_grad]) for m in (ref, model)))


def test_twice_and_block_types_raise():
    _, model = make_pair("gpt2", "eager")
    with pytest.raises(ValueError, match="block_types"):
        checkpoint_blocks(model, block_types="GPT2Block")
    checkpoint_blocks(model)
    with pytest.raises(RuntimeError, match="gradaccel is already on"):
        checkpoint_blocks(model)
    # HF's own checkpointing already on (as peft's prepare_model_for_kbit_training leaves it) is
    # taken over, not refused: tests/integrations/test_hf_takeover.py checks that nothing recomputes twice.


def test_pre_435_hook_is_handled_as_plain_model():
    # Remote code from before transformers 4.35 overrides the hook as (module, value): it cannot
    # take our function, so the blocks are wrapped directly.
    def old_hook(module, value=False):
        raise AssertionError("must not be called")

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config("gpt2", 0.1), attn_implementation="eager")
    model = copy.deepcopy(ref)
    for m in (model, model.transformer):
        m._set_gradient_checkpointing = old_hook
    checkpoint_blocks(model, budget=0.5)
    assert all(type(b).__name__ == "CheckpointedGPT2Block" for b in model.transformer.h)
    assert not any(b.gradient_checkpointing for b in model.transformer.h)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    for _ in range(2):
        ref.zero_grad(), model.zero_grad()
        assert_same_step(ref, model, ids)


def test_base_model_hook_used_when_only_the_head_is_old():
    def old_hook(module, value=False):
        raise AssertionError("must not be called")

    _, model = make_pair("gpt2", "eager")
    model._set_gradient_checkpointing = old_hook
    checkpoint_blocks(model, budget=0.5)
    assert all(b.gradient_checkpointing for b in model.transformer.h)


def test_plain_module_around_hf_model():
    # A custom head around a base model: the base model goes through its own hook.
    class Head(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.out = base, torch.nn.Linear(32, 2)

        def forward(self, ids):
            return self.out(self.base(input_ids=ids).last_hidden_state[:, -1]).square().mean()

    torch.manual_seed(0)
    ref = Head(transformers.AutoModel.from_config(_config("llama", 0.0), attn_implementation="sdpa"))
    model = checkpoint_blocks(copy.deepcopy(ref), budget=0.0)
    assert model.base.is_activation_checkpointing
    ids = torch.randint(1, VOCAB, (2, SEQ))
    a, b = ref(ids), model(ids)
    a.backward(), b.backward()
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert_grads_match(ref, model)


def _train(ref, model, make_opt, accum, windows, micro=2, clip=None):
    """Stock big-batch training of `ref` beside FusedAccumOptimizer micro-batch training of `model`."""
    from gradaccel import FusedAccumOptimizer

    ref_opt = make_opt(ref.parameters())
    opt = FusedAccumOptimizer(make_opt(model.parameters()), accum, max_grad_norm=clip)
    ref.train(), model.train()
    gen = torch.Generator().manual_seed(0)
    for _ in range(windows):
        ids = torch.randint(1, VOCAB, (accum * micro, SEQ), generator=gen)
        lm_loss(ref, ids).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        for k in range(accum):  # the stock loop, every micro-batch
            lm_loss(model, ids[k * micro:(k + 1) * micro]).backward()
            assert opt.step() == (k == accum - 1)
            opt.zero_grad()
        if clip is not None:
            assert opt.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)


@pytest.mark.parametrize("budget", [0.0, 0.5])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_accum_sgd_matches_big_batch(arch, budget):
    ref, model = make_pair(arch, "sdpa")
    checkpoint_blocks(model, budget=budget)
    _train(ref, model, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=0.01),
           accum=3, windows=3, clip=1.0 if budget else None)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        # Summation order differs (one batch vs three folded micro-batches): ulp-level only.
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6 * p.abs().max().item(), msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_accum_adamw_matches_big_batch(arch):
    lr = 1e-2
    ref, model = make_pair(arch, "eager")
    checkpoint_blocks(model, budget=0.5)
    _train(ref, model, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1), accum=2, windows=2)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        # Adam divides by |g|: an entry summed from large terms that nearly cancel carries the
        # ulp difference of those terms into its update (seen: up to 0.1% of lr). A bug (a lost
        # micro-batch, a wrong window) moves entries by ~lr.
        torch.testing.assert_close(q, p, rtol=0, atol=1e-2 * lr, msg=lambda m, name=name: f"{name}: {m}")
