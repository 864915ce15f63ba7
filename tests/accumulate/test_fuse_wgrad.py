"""FusedAccumOptimizer(fuse_wgrad=True): the weight gradients of nn.Linear / nn.Embedding go from
their GEMM straight into the fp32 window.

Against stock PyTorch: fp32 training equals big-batch training (tight tolerance) and the window
gradient equals ``acc.addmm_(dyᵀ, x)`` summed over micro-batches bit for bit (the same CPU
kernel); a bf16 model's window gradient against fp64 from the same activations and upstream
gradients (stock bf16 .grad, the fold, fused); no weight-sized gradient is alive in backward
(LiveBytes); and the compositions: normalize, clipping, non-finite, reset_window, resume
mid-window, tied weights, LoRA, gradaccel.checkpoint, the chunked loss, FSDP2's refusal.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradaccel
from gradaccel import FusedAccumOptimizer
from gradaccel.memory import LiveBytes


class Net(nn.Module):
    """Embedding -> Linear -> tanh -> Linear head (optionally tied to the embedding)."""

    def __init__(self, vocab=37, dim=24, hidden=40, tied=False, dtype=torch.float32, bias=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.norm = nn.LayerNorm(dim)
        if tied:
            self.head.weight = self.emb.weight
        self.to(dtype)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(self.norm(h))


def batch(seed, n=3, t=11, vocab=37):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g), torch.randint(0, vocab, (n, t), generator=g)


def loss_of(model, ids, labels, reduction="mean"):
    logits = model(ids).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction=reduction)


def window_grads(model, opt):
    """Each parameter's slice of the window buffer, shaped like it (before finalize)."""
    return {n: v.clone() for (n, p) in model.named_parameters()
            for q, v in zip(opt._slots.params, opt._slots.views) if q is p}


# --- routing ------------------------------------------------------------------------------------

def test_routes_linear_and_embedding_and_needs_the_model():
    model = Net(tied=True)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, fuse_wgrad=True, module=model)
    assert sorted(opt.fused_layers) == ["down", "emb", "head", "up"]
    with pytest.raises(ValueError, match="module=<the model>"):
        FusedAccumOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), 2, fuse_wgrad=True)
    with pytest.raises(TypeError, match="fuse_wgrad must be a bool"):
        FusedAccumOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), 2, fuse_wgrad=1, module=model)
    del opt
    import gc
    gc.collect()
    assert "forward" not in vars(model.up)  # the wrapper gone, the layers run their own forward


def test_no_weight_grad_is_made_and_bias_still_folds():
    model = Net()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, fuse_wgrad=True, module=model)
    seen = []
    model.up.bias.register_post_accumulate_grad_hook(lambda p: seen.append(("bias", p.grad is None)))
    model.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(("weight", p.grad is None)))
    loss_of(model, *batch(0)).backward()
    # A routed weight's post-accumulate-grad hook still fires, with .grad None (docs/accumulation.md);
    # so does the bias's, after the fold (registered first) has taken its gradient.
    assert sorted(seen) == [("bias", True), ("weight", True)]
    assert window_grads(model, opt)["up.weight"].abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())


# --- fp32: big batch, and addmm_ bit for bit ----------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("normalize", ["mean", "items", "sum"])
def test_fp32_training_equals_big_batch(tied, normalize):
    ref, model = Net(tied=tied), Net(tied=tied)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = FusedAccumOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 3, normalize=normalize,
                              max_grad_norm=0.5, fuse_wgrad=True, module=model)
    for window in range(3):
        parts = [batch(10 * window + k) for k in range(3)]
        ids, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        total = ids.numel()
        for k, (i, y) in enumerate(parts):
            if normalize == "items":
                loss_of(model, i, y, "sum").backward()
                opt.step(num_items=i.numel())
            elif normalize == "sum":
                (loss_of(model, i, y, "sum") / total).backward()
                opt.step()
            else:
                loss_of(model, i, y).backward()
                opt.step()
        loss_of(ref, ids, labels).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(opt.last_grad_norm - norm.item()) <= 1e-5 * norm.item()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_fp32_window_is_addmm_bit_for_bit():
    """The window slice of each Linear weight is ``acc.addmm_(dyᵀ, x)`` over the micro-batches."""
    model = Net(bias=False)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4, normalize="sum",
                              fuse_wgrad=True, module=model)
    refs = {name: torch.zeros_like(getattr(model, name).weight) for name in ("up", "down", "head")}
    for k in range(4):
        saved = {}
        for name in refs:
            def fwd_hook(mod, args, out, name=name):
                saved[name] = [args[0].detach()]
                out.register_hook(lambda g: saved[name].append(g.detach()))
            saved[name + "_h"] = getattr(model, name).register_forward_hook(fwd_hook)
        loss_of(model, *batch(k)).backward()
        for name, acc in refs.items():
            saved.pop(name + "_h").remove()
            x, dy = saved[name]
            acc.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        if k < 3:
            opt.step()
    got = window_grads(model, opt)
    for name, acc in refs.items():
        assert torch.equal(got[f"{name}.weight"], acc), name


# --- bf16: the numbers of issue 29 ---------------------------------------------------------------

def _bf16_window(mode, steps=16):
    """A bf16 Linear stack's window gradient over ``steps`` micro-batches, and its fp64 reference
    from the very activations and upstream gradients of this run. mode: stock, fold, fused."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 48))
    model = layers.to(torch.bfloat16)
    lin = [m for m in model if isinstance(m, nn.Linear)]
    ref = [torch.zeros(m.weight.shape, dtype=torch.float64) for m in lin]
    handles = []
    for m, r in zip(lin, ref):
        def hook(mod, args, out, r=r):
            x = args[0].detach().double()

            def on_grad(g):
                r.add_(g.double().reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
            out.register_hook(on_grad)
        handles.append(m.register_forward_hook(hook))
    opt = None
    if mode != "stock":
        opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), steps, normalize="sum",
                                  fuse_wgrad=mode == "fused", module=model if mode == "fused" else None)
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        x = torch.randn(8, 32, 64, generator=g).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        if opt is not None and k < steps - 1:
            opt.step()
    if opt is None:
        got = [m.weight.grad.double() for m in lin]
    else:
        views = {id(p): v for p, v in zip(opt._slots.params, opt._slots.views)}
        got = [views[id(m.weight)].double() for m in lin]
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))


def test_bf16_fused_window_is_at_fp32_gemm_accuracy():
    stock, fold, fused = _bf16_window("stock"), _bf16_window("fold"), _bf16_window("fused")
    assert fused <= 1e-5, (stock, fold, fused)
    assert fused * 100 <= fold <= stock, (stock, fold, fused)


# --- memory: no weight-sized gradient in backward ------------------------------------------------

def _step_peak(fuse: bool) -> tuple[int, int, int]:
    """(peak of the step, peak of its backward above the bytes live when backward began, bytes
    of the largest weight's bf16 gradient) for a bf16 model whose weights, not its activations,
    set the peak (4 tokens, vocabulary 4096)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4096, bias=False))
    model.to(torch.bfloat16)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4, normalize="sum",
                              fuse_wgrad=fuse, module=model if fuse else None)
    ids = torch.randint(0, 4096, (1, 4))
    loss_of(model, ids, ids).backward()  # warm: one-offs out of the measured step
    opt.step()
    with LiveBytes() as live:
        loss = loss_of(model, ids, ids)
        live.set_phase("backward")
        loss.backward()
        opt.step()
    start, peak = live.phases["backward"]
    return live.peak, peak - start, model[3].weight.numel() * 2


def test_no_weight_sized_gradient_is_alive_in_backward():
    fold_peak, fold_backward, head_grad = _step_peak(False)
    fused_peak, fused_backward, _ = _step_peak(True)
    # The fold's backward holds the head's bf16 gradient (less the activations freed by then);
    # fused, nothing a quarter of it is ever alive.
    assert fold_backward >= head_grad * 9 // 10, (fold_backward, head_grad)
    assert fused_backward < head_grad // 4, (fused_backward, head_grad)
    assert fold_backward - fused_backward >= head_grad * 3 // 4
    assert fused_peak < fold_peak - head_grad * 3 // 4, (fold_peak, fused_peak)


# --- compositions --------------------------------------------------------------------------------

def _twins(**kw):
    a, b = Net(tied=kw.pop("tied", False)), None
    b = copy.deepcopy(a)
    oa = FusedAccumOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), 2, **kw)
    ob = FusedAccumOptimizer(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9), 2, fuse_wgrad=True, module=b, **kw)
    return a, oa, b, ob


def _assert_same(a, b, rtol=1e-5):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-6, msg=n)


def test_reset_window_and_non_finite_skip():
    a, oa, b, ob = _twins()
    for model, opt in ((a, oa), (b, ob)):
        loss_of(model, *batch(0)).backward()
        opt.reset_window()  # dropped: the next window starts clean
        for k in range(2):
            loss_of(model, *batch(k + 1)).backward()
            opt.step()
        # a non-finite window is skipped, on the fused path too
        loss_of(model, *batch(5)).backward()
        opt.step()
        (loss_of(model, *batch(6)) * float("inf")).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert opt.step() is False
        assert opt.skipped_steps == 1
    _assert_same(a, b)


def test_resume_mid_window():
    a, oa, b, ob = _twins(tied=True)
    loss_of(a, *batch(0)).backward()
    oa.step()
    loss_of(b, *batch(0)).backward()
    ob.step()
    sd = copy.deepcopy(ob.state_dict())
    c = copy.deepcopy(b)
    del ob
    oc = FusedAccumOptimizer(torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9), 2, fuse_wgrad=True, module=c)
    oc.load_state_dict(sd)
    for model, opt in ((a, oa), (c, oc)):
        loss_of(model, *batch(1)).backward()
        assert opt.step()
    _assert_same(a, c)


def test_tied_weight_used_by_two_routed_layers_and_by_f_linear():
    """A weight used three times (embedding, routed head, unrouted F.linear) sums all three,
    whichever arrives first."""
    class Three(Net):
        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h) + F.linear(h * 0.5, self.emb.weight)
    a = Three(tied=True)
    b = copy.deepcopy(a)
    opt = FusedAccumOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), 1, normalize="sum", fuse_wgrad=True, module=b)
    ids, y = batch(3)
    loss_of(a, ids, y).backward()
    loss_of(b, ids, y).backward()
    got = window_grads(b, opt)["emb.weight"]
    torch.testing.assert_close(got, a.emb.weight.grad, rtol=1e-5, atol=1e-7)


def test_under_gradaccel_checkpoint():
    class Ckpt(Net):
        def forward(self, ids):
            h = self.emb(ids)
            h = gradaccel.checkpoint(lambda z: z + self.down(torch.tanh(self.up(z))), h, budget=0.5)
            return self.head(self.norm(h))
    torch.manual_seed(0)
    a = Ckpt()
    b = copy.deepcopy(a)
    oa = FusedAccumOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), 2)
    ob = FusedAccumOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), 2, fuse_wgrad=True, module=b)
    for k in range(6):  # the first call traces and plans, later ones replay
        for model, opt in ((a, oa), (b, ob)):
            loss_of(model, *batch(k)).backward()
            opt.step()
    _assert_same(a, b)


def test_with_the_chunked_loss():
    """The chunked loss computes the head's gradient itself: that weight keeps the fold, the rest
    is routed, and training matches the fold."""
    from gradaccel.memory.chunked_loss import ChunkedLinearCrossEntropy

    class Chunked(Net):
        def forward(self, ids, labels):
            h = self.emb(ids)
            h = self.norm(h + self.down(torch.tanh(self.up(h))))
            return ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), self.head.weight, None, None,
                                                   labels.reshape(-1), labels.numel(), -100, 7)
    a = Chunked()
    b = copy.deepcopy(a)
    oa = FusedAccumOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), 2)
    ob = FusedAccumOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), 2, fuse_wgrad=True, module=b)
    for k in range(4):
        for model, opt in ((a, oa), (b, ob)):
            model(*batch(k)).backward()
            opt.step()
    _assert_same(a, b)


def test_lora_adapters_are_routed_and_base_weights_make_no_grad():
    peft = pytest.importorskip("peft")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(16, 16)
            self.o = nn.Linear(16, 8)

        def forward(self, x):
            return self.o(torch.relu(self.q(x)))

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "o"], lora_dropout=0.0, init_lora_weights=False)
    a = peft.get_peft_model(Tiny(), cfg)
    b = copy.deepcopy(a)
    oa = FusedAccumOptimizer(torch.optim.SGD([p for p in a.parameters() if p.requires_grad], lr=0.1), 2)
    ob = FusedAccumOptimizer(torch.optim.SGD([p for p in b.parameters() if p.requires_grad], lr=0.1), 2,
                             fuse_wgrad=True, module=b)
    assert ob.fused_layers and all("lora_" in n for n in ob.fused_layers)
    g = torch.Generator().manual_seed(2)
    for k in range(4):
        x = torch.randn(5, 16, generator=g)
        for model, opt in ((a, oa), (b, ob)):
            model(x).square().mean().backward()
            opt.step()
    _assert_same(a, b)
    assert all(p.grad is None for p in b.parameters())


def test_autocast_bf16_matches_the_fold():
    """Under autocast the routed layers save and multiply in bf16 as stock does; their window
    gradient is the fold's without its per-micro-batch bf16 rounding."""
    a, oa, b, ob = _twins()
    for model, opt in ((a, oa), (b, ob)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, *batch(0))
        loss.backward()
    ga, gb = window_grads(a, oa), window_grads(b, ob)
    for n in ga:
        rel = ((ga[n] - gb[n]).norm() / ga[n].norm()).item()
        assert rel < 1e-2, (n, rel)


def test_hf_llama_tied_under_checkpoint_blocks():
    """A tied HF Llama (embedding and head share a weight), checkpointed by gradaccel: fused
    training equals the fold's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(cfg)
    b = copy.deepcopy(a)
    assert b.lm_head.weight is b.model.embed_tokens.weight
    for m in (a, b):
        gradaccel.checkpoint_blocks(m, budget=0.5)
        m.train()
    oa = FusedAccumOptimizer(torch.optim.AdamW(a.parameters(), lr=1e-2), 2)
    ob = FusedAccumOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2), 2, fuse_wgrad=True, module=b)
    assert "lm_head" in ob.fused_layers and "model.embed_tokens" in ob.fused_layers
    g = torch.Generator().manual_seed(3)
    for k in range(6):
        ids = torch.randint(0, 96, (2, 9), generator=g)
        for model, opt in ((a, oa), (b, ob)):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    _assert_same(a, b, rtol=1e-4)


def test_under_torch_compile_equals_the_fold():
    """torch.compile: routed layers are a deliberate graph break (their C++ autograd function runs
    eagerly) that Dynamo does not warn of, and training equals the fold's."""
    import torch._dynamo

    def train(fuse):
        torch._dynamo.reset()
        model = Net()
        opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2,
                                  fuse_wgrad=fuse, module=model if fuse else None)
        compiled = torch.compile(model, backend="eager")
        for k in range(4):
            ids, labels = batch(k)
            logits = compiled(ids).float()
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    folded = train(False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused = train(True)
    noted = [str(w.message) for w in seen]
    assert not [m for m in noted if "does not know how to trace" in m or "lru_cache" in m], noted
    for a, b in zip(folded, fused):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
