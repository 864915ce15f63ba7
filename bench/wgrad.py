"""The accumulate suite's window rows: a model's weight gradients over a window of micro-batches,
three ways, side by side in one run:

- ``torch-stock``: stock PyTorch accumulation, ``.grad`` summed in the model's dtype, one
  ``optimizer.step()`` per window;
- ``gradaccel-fold``: ``FusedAccumOptimizer`` (each ``.grad`` folded into the fp32 window);
- ``gradaccel-fused``: ``FusedAccumOptimizer(fuse_wgrad=True)`` (the ``nn.Linear`` and
  ``nn.Embedding`` weight gradients go from their GEMM straight into the fp32 window).

Models: a stack of ``nn.Linear`` layers, and a small Hugging Face Llama with a 32K vocabulary
(untied head), each in bf16 and in fp32.

And the full fine-tune's step with the loss in chunks (issue 29's number): the same Llama in head
mode (gradaccel/memory/chunked_loss.py: no whole logits; the chunks' head gradient goes into the
window under ``fuse_wgrad``), ``gradaccel-fold`` and ``gradaccel-fused``, beside ``torch-stock``
(the model's own loss, whole logits, stock ``.grad``). Rows ``peak_bytes`` and ``window_time`` as
above; ``largest_in_backward`` (B): the largest storage one micro-batch's backward makes;
``largest_weight_grad`` (B): the bytes of the largest fused weight's gradient (the head's, V x C
in the model's dtype), which the fused peak should fall below the fold's by; and
``peak_below_fold`` (B): by how much it fell. A sequence of two chunks of rows (see
:func:`chunked_head_rows`).

And ``layer_overhead`` (s, :func:`overhead_rows`): what routing costs per layer and micro-batch
on layers whose GEMMs cost nothing, fold and fused over stock.

Metrics:

- ``window_time`` (s, median, interleaved): forward, backward and the optimizer's ``step`` of
  every micro-batch of a window (SGD, lr 0: the update's own cost is the same for all three).
- ``peak_bytes`` (B, exact): the most live tensor bytes during a window
  (``gradaccel.memory.LiveBytes``), beyond what was live before it.
- ``grad_error`` (relative, Frobenius): the window gradient of every ``nn.Linear`` and
  ``nn.Embedding`` weight, against fp64 sums computed from the very activations and upstream
  gradients of the same run (forward and tensor hooks); the worst layer is reported.
"""

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.common import progress, time_interleaved, tiny
from gradaccel import FusedAccumOptimizer
from gradaccel.memory import LiveBytes
from gradaccel.memory.chunked_loss import chunk_rows
from gradaccel.memory.counter import StorageLog

VARIANTS = ("torch-stock", "gradaccel-fold", "gradaccel-fused")
ERROR_WINDOW = 16  # micro-batches of the exactness rows (issue 29's setting)


class LinearStack(nn.Module):
    """``layers`` Linear layers of width ``width`` with GELU between, and a squared-mean loss."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(F.gelu(x))
        return x.float().square().mean()


class Llama(nn.Module):
    """A Hugging Face Llama causal LM, loss = its own causal cross-entropy."""

    def __init__(self, hidden: int, layers: int, vocab: int) -> None:
        super().__init__()
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256, tie_word_embeddings=False)
        self.lm = transformers.LlamaForCausalLM(cfg)

    def chunked(self) -> "Llama":
        """This model with its loss in chunks (head mode: no whole logits); returns self."""
        from gradaccel.memory.chunked_loss import install_head, set_head
        assert install_head(self.lm)
        set_head(self.lm, True)
        return self

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def _cases(quick: bool) -> list[tuple]:
    """(name, model factory, micro-batch factory, micro-batches per timed window)."""
    # bf16 GEMMs run ~30x slower than fp32 on a CPU without AVX-512 BF16 (measured here), so
    # the quick sizes stay small: a window of a bf16 case is then seconds.
    if tiny():
        stack, llama, tokens, lm_tokens, window = (64, 2), (32, 1, 1024), (2, 8), (1, 8), 2
    elif quick:
        stack, llama, tokens, lm_tokens, window = (256, 4), (128, 2, 32000), (2, 64), (1, 16), 4
    else:
        stack, llama, tokens, lm_tokens, window = (512, 6), (256, 2, 32000), (4, 128), (1, 64), 8
    width, n = stack
    hidden, layers, vocab = llama
    b, t = tokens
    lb, lt = lm_tokens

    def stack_batch(gen, dtype):
        return torch.randn(b, t, width, generator=gen).to(dtype)

    def llama_batch(gen, dtype):
        return torch.randint(0, vocab, (lb, lt), generator=gen)

    return [(f"linear stack {n}x{width}", lambda: LinearStack(width, n), stack_batch, window),
            (f"llama h{hidden} L{layers} v{vocab // 1000}k", lambda: Llama(hidden, layers, vocab), llama_batch, window)]


def _window_rows(case, runs, batches, device, reps, add) -> dict[str, int]:
    """``window_time`` (interleaved) and ``peak_bytes`` (exact) of a window, per variant; returns
    the peaks."""
    fns = {v: (lambda r=r: r.window(batches)) for v, r in runs.items()}
    times = time_interleaved(fns, device, warmup=1, reps=reps)
    peaks = {}
    for v, r in runs.items():
        with LiveBytes() as live:
            r.window(batches)
        peaks[v] = live.peak
        add(case, v, "window_time", times[v], "s")
        add(case, v, "peak_bytes", live.peak, "B")
    return peaks


def _largest_in_backward(run: "_Run", batch) -> int:
    """The largest storage one micro-batch's backward makes (the window is then dropped)."""
    loss = run.model.loss(batch)
    with StorageLog() as mode:
        loss.backward()
    run.opt.zero_grad()
    if isinstance(run.opt, FusedAccumOptimizer):
        run.opt.reset_window()
    return mode.largest


def chunked_head_rows(device: str, quick: bool, add) -> None:
    """The full fine-tune's step with the loss in chunks (see the module doc): the Llama case of
    :func:`_cases`, bf16 and fp32, on a sequence of two chunks of rows.

    Two chunks, because in one the loss computes the head's gradient as stock autograd does (one
    GEMM in the model's dtype, made after the chunk's logits are dropped) and both variants then
    peak at the chunk's fp32 logits: the fused peak falls by the gradient less those logits. Over
    several chunks the fold sums the head's gradient in an fp32 buffer alive through the loop, as
    at any real length (2,048 tokens at a 128K vocabulary are 32 chunks)."""
    name, make_model, _, window = _cases(quick)[1]
    window = min(window, 2)  # a bf16 micro-batch of 262 rows is seconds here; the peak is one window's
    reps = 3 if quick or tiny() else 5
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        case = f"step {name} loss in chunks {tag}"
        progress(case)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            base = make_model().to(dtype)
            runs = {v: _Run(v, copy.deepcopy(base) if v == "torch-stock" else copy.deepcopy(base).chunked(), window)
                    for v in VARIANTS}
            vocab = base.lm.config.vocab_size
            rows = 8 if tiny() else 2 * chunk_rows(1, vocab)
            gen = torch.Generator().manual_seed(2)
            batches = [torch.randint(0, vocab, (1, rows), generator=gen) for _ in range(window)]
            peaks = _window_rows(case, runs, batches, device, reps, add)
            for v, r in runs.items():
                add(case, v, "largest_in_backward", _largest_in_backward(r, batches[0]), "B")
            head = runs["gradaccel-fused"].model.lm.lm_head.weight
            assert "lm.lm_head" in runs["gradaccel-fused"].opt.fused_layers
            add(case, "gradaccel-fused", "largest_weight_grad", head.numel() * head.element_size(), "B")
            add(case, "gradaccel-fused", "peak_below_fold", peaks["gradaccel-fold"] - peaks["gradaccel-fused"], "B")
            del runs, base


class _Run:
    """One variant: its model copy, its optimizer, and a window of micro-batches."""

    def __init__(self, variant: str, model: nn.Module, accum: int) -> None:
        self.variant, self.model, self.accum = variant, model, accum
        inner = torch.optim.SGD(model.parameters(), lr=0.0)
        if variant == "torch-stock":
            self.opt = inner
        else:
            self.opt = FusedAccumOptimizer(inner, accum, normalize="sum", fuse_wgrad=variant == "gradaccel-fused",
                                           module=model if variant == "gradaccel-fused" else None)

    def micro(self, batch, step: bool) -> None:
        """One micro-batch's backward; ``step``: then the wrapper's per-micro-batch step()."""
        self.model.loss(batch).backward()
        if step and isinstance(self.opt, FusedAccumOptimizer):
            self.opt.step()

    def window(self, batches: list) -> None:
        """A whole window, update included (lr 0)."""
        for batch in batches:
            self.micro(batch, step=True)  # the wrapper's last step() ends the window
        if not isinstance(self.opt, FusedAccumOptimizer):
            self.opt.step()
        self.opt.zero_grad()

    def window_grads(self) -> dict[str, torch.Tensor]:
        """The window gradient of each weight (before the step that would use it)."""
        if isinstance(self.opt, FusedAccumOptimizer):
            views = {id(p): v for p, v in zip(self.opt._slots.params, self.opt._slots.views)}
            return {n: views[id(p)].double() for n, p in self.model.named_parameters() if id(p) in views}
        return {n: p.grad.double() for n, p in self.model.named_parameters() if p.grad is not None}


def _fp64_reference(model: nn.Module) -> tuple[dict, list]:
    """fp64 weight-gradient sums of every Linear/Embedding, fed by hooks on the live run."""
    ref, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            acc = ref.setdefault(name + ".weight", torch.zeros(m.weight.shape, dtype=torch.float64))

            def hook(mod, args, out, acc=acc):
                x = args[0].detach().double().reshape(-1, args[0].shape[-1])

                def on_grad(g):
                    acc.add_(g.double().reshape(-1, g.shape[-1]).t() @ x)
                out.register_hook(on_grad)
        elif isinstance(m, nn.Embedding):
            acc = ref.setdefault(name + ".weight", torch.zeros(m.weight.shape, dtype=torch.float64))

            def hook(mod, args, out, acc=acc):
                ids = args[0].detach().reshape(-1)

                def on_grad(g):
                    acc.index_add_(0, ids, g.double().reshape(-1, g.shape[-1]))
                out.register_hook(on_grad)
        else:
            continue
        handles.append(m.register_forward_hook(hook))
    return ref, handles


def grad_error(make_model, make_batch, dtype: torch.dtype, variant: str, steps: int = ERROR_WINDOW) -> float:
    """The worst relative error of a window's weight gradients against fp64 (see the module doc)."""
    torch.manual_seed(0)
    model = make_model().to(dtype)
    run = _Run(variant, model, steps)
    ref, handles = _fp64_reference(model)
    gen = torch.Generator().manual_seed(1)
    for k in range(steps):  # the window's last step() is not taken: it would finalize the buffer
        run.micro(make_batch(gen, dtype), step=k < steps - 1)
    for h in handles:
        h.remove()
    got = run.window_grads()
    return max(((got[n] - r).norm() / r.norm()).item() for n, r in ref.items() if r.norm() > 0)


def overhead_rows(device: str, quick: bool, add) -> None:
    """What routing costs per layer where the GEMMs cost nothing: a stack of 16 Linear layers of
    width 16 on 8 tokens, fp32. ``window_time`` of the three variants, and ``layer_overhead``
    (s): fold's and fused's extra time over stock per layer and micro-batch (the fold's hooks; the
    fused path's autograd function, ``gradaccel.ops.wgrad.fused_linear``, and its window sink)."""
    layers, window = 16, 4
    case = f"window linear stack {layers}x16 8 tokens fp32"
    progress(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        base = LinearStack(16, layers)
        runs = {v: _Run(v, copy.deepcopy(base), window) for v in VARIANTS}
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(1, 8, 16, generator=gen) for _ in range(window)]
    times = time_interleaved({v: (lambda r=r: r.window(batches)) for v, r in runs.items()}, device,
                             warmup=3, reps=5 if tiny() else 41)
    for v in VARIANTS:
        add(case, v, "window_time", times[v], "s")
        if v != "torch-stock":
            add(case, v, "layer_overhead", (times[v] - times["torch-stock"]) / (layers * window), "s")


def run_rows(device: str, quick: bool, add) -> None:
    """Adds the window rows (``add(case, variant, metric, value, unit)``); CPU only (the GPU
    check of the kernel is bench/wgrad_gpu.py, run by bench/gpu.sh)."""
    if device != "cpu":
        return
    cases = _cases(quick)
    reps = 3 if quick or tiny() else 5
    for k, (name, make_model, make_batch, window) in enumerate(cases):
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            case = f"window {name} {tag}"
            progress(case, 2 * k + (tag == "fp32") + 1, 2 * len(cases))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                base = make_model().to(dtype)
                runs = {v: _Run(v, copy.deepcopy(base), window) for v in VARIANTS}
                gen = torch.Generator().manual_seed(2)
                _window_rows(case, runs, [make_batch(gen, dtype) for _ in range(window)], device, reps, add)
                del runs, base
                for v in VARIANTS:
                    add(case, v, "grad_error", grad_error(make_model, make_batch, dtype, v,
                                                          4 if tiny() else ERROR_WINDOW), "rel")
    overhead_rows(device, quick, add)
    chunked_head_rows(device, quick, add)
