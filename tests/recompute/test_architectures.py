"""Breadth: gradaccel.checkpoint plans, and replays exactly, the blocks of many model families.

A toy MoE block first (routing by integer indices that change on every call), then tiny random
Hugging Face models (no downloads) of decoders, encoders, encoder-decoders, vision, audio, MoE
and state-space families, each against the same model without checkpointing.
"""

import copy
import functools
import warnings

import pytest
import torch

import gradaccel
from gradaccel.recompute.checkpoint import plan_rows, reset_plans


class ToyMoE(torch.nn.Module):
    """Top-k routing to experts gathered by integer index: ``w1[idx]`` is ``aten.index.Tensor``."""

    def __init__(self, d=16, experts=4, k=2):
        super().__init__()
        self.router = torch.nn.Linear(d, experts)
        self.w1 = torch.nn.Parameter(torch.randn(experts, d, 2 * d) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(experts, 2 * d, d) * 0.2)
        self.k = k

    def forward(self, x):
        weights, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        h = torch.einsum("nd,nkdf->nkf", x, self.w1[idx]).relu()
        y = torch.einsum("nkf,nkfd->nkd", h, self.w2[idx])
        picked = x.gather(0, idx[:, :1].expand(-1, x.shape[1]))  # gather by routing index too
        return (y * weights.unsqueeze(-1)).sum(1) + picked.index_select(0, idx[:, 0])


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_moe_routing_replays_the_current_call(budget):
    # A new input every step moves the routing away from the traced call's: replay must gather
    # with this call's indices (a frozen trace constant would give wrong gradients).
    reset_plans()
    torch.manual_seed(0)
    moe = ToyMoE()
    routes = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the region is selective
        for step in range(4):
            x = torch.randn(12, 16, requires_grad=True)
            params = [x, *moe.parameters()]
            expected = torch.autograd.grad(moe(x).square().sum(), params)
            got = torch.autograd.grad(gradaccel.checkpoint(moe, x, budget=budget).square().sum(), params)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=0)  # the same kernels run in the same order
            routes.add(tuple(moe.router(x).topk(2, dim=-1).indices.flatten().tolist()))
    assert len(routes) == 4  # the routing did change between calls
    (row,) = plan_rows()
    assert row["mode"] == "selective" and row["calls"] == 4
    if budget < 1.0:
        assert "aten.index.Tensor" in row["replayed_ops"]  # the gather is rebuilt, not kept


# -- tiny Hugging Face models -----------------------------------------------------------------
transformers = pytest.importorskip("transformers")

from gradaccel import checkpoint_blocks  # noqa: E402

V, S, B = 64, 8, 2
# Shared by most configs (aliases such as GPT-2's n_embd map onto these names).
BASE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CONV_AUDIO = dict(conv_dim=[16, 16], conv_stride=[5, 4], conv_kernel=[10, 4], num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0)  # no numpy-random masks
SEQ2SEQ = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64)


def _text(g):
    return {"input_ids": torch.randint(1, V, (B, S), generator=g)}


def _seq2seq(g):
    ids = torch.randint(1, V, (2 * B, S), generator=g)
    return {"input_ids": ids[:B], "decoder_input_ids": ids[B:]}


def _image(g):
    return {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}


def _wave(g):
    return {"input_values": torch.randn(B, 800, generator=g)}


def _speech2text(g):
    return {"input_features": torch.randn(B, 16, 40, generator=g),
            "decoder_input_ids": torch.randint(1, V, (B, S), generator=g)}


# family -> {model_type: (config overrides, inputs)}. `None` in overrides: no BASE (the config
# reads those names differently, e.g. Swin's per-stage head counts).
ARCHITECTURES = {
    "decoder": {
        "llama": ({}, _text), "mistral": ({}, _text), "qwen2": ({}, _text), "qwen3": ({"head_dim": 8}, _text),
        "gemma": ({"head_dim": 8}, _text), "gemma2": ({"head_dim": 8}, _text), "phi3": ({}, _text),
        "gpt2": ({}, _text), "gpt_neox": ({}, _text), "falcon": ({}, _text),  # falcon: fused_qkv[..., [-2], :]
        "opt": ({"ffn_dim": 64, "word_embed_proj_dim": 32}, _text), "bloom": ({}, _text),
        "gptj": ({"rotary_dim": 4}, _text), "starcoder2": ({}, _text), "olmo": ({}, _text),
    },
    "moe": {
        "mixtral": (MOE, _text), "qwen2_moe": ({**MOE, "shared_expert_intermediate_size": 16}, _text),
        "qwen3_moe": ({**MOE, "head_dim": 8}, _text), "olmoe": (MOE, _text), "phimoe": (MOE, _text),
        "deepseek_v3": ({**MOE, "n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                         "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                         "v_head_dim": 8, "n_shared_experts": 1}, _text),
        "gpt_oss": ({**MOE, "head_dim": 8, "layer_types": ["sliding_attention", "full_attention"],
                     "sliding_window": 4}, _text),
    },
    "state_space": {
        "mamba": ({"state_size": 4}, _text),
        "mamba2": ({"state_size": 4, "num_heads": 8, "head_dim": 8, "n_groups": 1}, _text),
        "jamba": ({**MOE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                   "expert_layer_offset": 1, "mamba_d_state": 4, "mamba_dt_rank": 4,
                   "use_mamba_kernels": False}, _text),
        "qwen3_next": ({**MOE, "shared_expert_intermediate_size": 16, "head_dim": 8, "linear_num_key_heads": 2,
                        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                        "layer_types": ["linear_attention", "full_attention"]}, _text),
    },
    "encoder": {
        "bert": ({}, _text), "roberta": ({}, _text), "electra": ({"embedding_size": 32}, _text),
        "distilbert": ({"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64}, _text),
        "deberta-v2": ({}, _text), "albert": ({"embedding_size": 32}, _text),
    },
    "encoder_decoder": {
        "t5": ({"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8}, _seq2seq),
        "bart": (SEQ2SEQ, _seq2seq),
    },
    "vision": {
        "vit": ({"image_size": 32, "patch_size": 8}, _image),
        "dinov2": ({"image_size": 32, "patch_size": 8}, _image),
        "swin": (None, _image), "convnext": ({"hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2}, _image),
    },
    "audio": {
        "wav2vec2": (CONV_AUDIO, _wave), "hubert": (CONV_AUDIO, _wave),
        "whisper": ({**SEQ2SEQ, "num_mel_bins": 16, "max_source_positions": 20, "max_target_positions": 16},
                    _speech2text),
    },
}
SWIN = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
CASES = [pytest.param(t, id=f"{family}-{t}") for family, archs in ARCHITECTURES.items() for t in archs]
INPUTS = {t: inputs for archs in ARCHITECTURES.values() for t, (_, inputs) in archs.items()}


def _model(model_type, **extra):
    family = next(archs for archs in ARCHITECTURES.values() if model_type in archs)
    overrides = family[model_type][0]
    kwargs = SWIN if overrides is None else {**BASE, **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, **extra).train()  # config dropout stays on


def _loss(out):
    hidden = out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out[0]
    return (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))).sum()


def _assert_same_steps(ref, model, inputs, steps=2):
    for step in range(steps):  # the trace, then a planned call on new inputs (new MoE routing)
        batch = inputs(torch.Generator().manual_seed(step))
        for m in (ref, model):
            m.zero_grad()
            torch.manual_seed(step)  # the same dropout masks in both
            _loss(m(**batch)).backward()
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                # Bit-exact in most models; a few reductions (T5's, GPT-2's) may reorder at ulp
                # level between the forward and its replay, relative to each tensor's scale.
                scale = p.grad.abs().max().item() or 1.0
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("model_type", CASES)
def test_blocks_get_a_selective_plan_and_the_same_gradients(model_type):
    reset_plans()
    ref = _model(model_type)
    model = copy.deepcopy(ref)
    checkpoint_blocks(model, budget=0.5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")  # no fallback, no divergence
        _assert_same_steps(ref, model, INPUTS[model_type])
    rows = plan_rows()
    assert rows and all(r["mode"] == "selective" for r in rows), [r["mode"] for r in rows]
    assert all(r["calls"] >= 2 for r in rows)  # traced once, then planned: nothing retraced (ALBERT shares one layer)
    assert any(r["replayed_ops"] for r in rows)  # the budget did drop something


def test_eager_moe_experts_are_split_off_and_the_rest_is_planned():
    # Mixtral's eager experts loop over the experts `nonzero` picks: truly data dependent. That
    # submodule alone runs as torch.utils.checkpoint; attention and routing keep a selective plan.
    reset_plans()
    ref = _model("mixtral", experts_implementation="eager")
    model = copy.deepcopy(ref)
    checkpoint_blocks(model, budget=0.5)
    with pytest.warns(UserWarning, match="MixtralExperts runs .* torch.utils.checkpoint"):
        _assert_same_steps(ref, model, _text, steps=3)
    rows = plan_rows()
    assert len(rows) == 2 and all(r["mode"] == "selective" and r["calls"] == 2 for r in rows)
    assert all(r["split"] == [r["split"][0]] and r["split"][0].startswith("MixtralExperts") for r in rows)
    assert all("aten.topk.default" in r["replayed_ops"] + r["kept_ops"] for r in rows)  # routing is planned


class _EagerExperts(torch.nn.Module):
    """Loops over the experts that `nonzero` finds hit, with dropout inside: data dependent."""

    def __init__(self, d=8, experts=3):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(experts))

    def forward(self, x, idx):
        out = torch.zeros_like(x)
        for e in (idx.bincount(minlength=len(self.experts)) > 0).nonzero().flatten().tolist():
            rows = (idx == e).nonzero().flatten()
            out = out.index_add(0, rows, torch.nn.functional.dropout(self.experts[e](x[rows]).tanh(), 0.2))
        return out


class _EagerBlock(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.router, self.up, self.moe = torch.nn.Linear(d, 3), torch.nn.Linear(d, d), _EagerExperts(d)

    def forward(self, x):
        h = self.up(x).sigmoid()
        y = self.moe(h, self.router(h).argmax(-1))
        return torch.nn.functional.dropout(y.exp() * h, 0.3) + x  # random ops after the split-off part too


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_a_data_dependent_submodule_is_split_off(budget):
    reset_plans()
    torch.manual_seed(0)
    block = _EagerBlock()
    params = list(block.parameters())
    with pytest.warns(UserWarning, match="_EagerExperts runs"):
        for step in range(4):  # trace (then split), trace again, then planned calls; routing moves
            x = torch.randn(10, 8, requires_grad=True)
            torch.manual_seed(step)
            expected = torch.autograd.grad(block(x).sum(), [x, *params], allow_unused=True)
            torch.manual_seed(step)
            got = torch.autograd.grad(gradaccel.checkpoint(block, x, budget=budget).sum(), [x, *params],
                                      allow_unused=True)
            for g, e in zip(got, expected):
                assert (g is None) == (e is None)
                if e is not None:
                    torch.testing.assert_close(g, e, rtol=0, atol=0)  # same kernels, same masks
    (row,) = plan_rows()
    assert row["mode"] == "selective" and row["calls"] == 3 and row["split"][0].startswith("_EagerExperts")


# -- a warm-up on copies of the inputs ------------------------------------------------------------
def _copy(x, memo: dict):
    """``x`` on a fresh storage with the same values, geometry and requires_grad (a leaf where
    ``x`` may be a non-leaf); arguments that share a storage share the copy. Others as they are."""
    if not isinstance(x, torch.Tensor):
        return x
    storage = memo.setdefault(x.untyped_storage()._cdata, x.untyped_storage().clone())
    copy = torch.empty(0, dtype=x.dtype, device=x.device).set_(storage, x.storage_offset(), x.shape, x.stride())
    return copy.requires_grad_(x.requires_grad)


def _warmed_up_on_copies(checkpoint_fn):
    """A layer's checkpoint function that first runs the layer on copies of all its inputs (the
    partial's keywords too: the shared rotary tables, masks, position bias), as transformers' own
    gradient-checkpointing tests do before each call, then on the inputs themselves."""
    def run(fn, *args, **kwargs):
        memo = {}
        copy = functools.partial(_copy, memo=memo)
        copied = functools.partial(fn.func, *map(copy, fn.args), **{k: copy(v) for k, v in fn.keywords.items()})
        with torch.random.fork_rng():
            checkpoint_fn(copied, *map(copy, args), **{k: copy(v) for k, v in kwargs.items()})
        return checkpoint_fn(fn, *args, **kwargs)
    return run


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "gpt2", "falcon", "bloom", "t5", "whisper"])
def test_a_plan_made_on_copies_of_the_inputs_serves_the_inputs(model_type):
    # The trace saw leaf copies; the planned call sees the inputs, non-leaves made by the layers
    # before: what matters to the region is the same (shapes, strides, aliasing, requires_grad).
    reset_plans()
    ref = _model(model_type)
    model = copy.deepcopy(ref)
    checkpoint_blocks(model, budget=0.5)
    layers = [m for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None) is not None]
    assert layers
    for layer in layers:
        layer._gradient_checkpointing_func = _warmed_up_on_copies(layer._gradient_checkpointing_func)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")  # no "saved different tensors"
        _assert_same_steps(ref, model, INPUTS[model_type])
    rows = plan_rows()
    # Traced once, on the copies; every call after it (the inputs, then both again) planned.
    assert rows and all(r["mode"] == "selective" and r["calls"] == 4 for r in rows), \
        [(r["region"], r["mode"], r["calls"]) for r in rows]
