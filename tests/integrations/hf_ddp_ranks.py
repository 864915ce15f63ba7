"""The rank script of tests/integrations/test_hf_ddp.py, launched as a user launches a Trainer script:
``torchrun --nproc_per_node 2 tests/integrations/hf_ddp_ranks.py OUT_DIR`` (CPU, gloo).

Every scenario runs on both ranks, in order, and each rank writes ``OUT_DIR/rank{r}.json``:
{scenario: "ok" or the traceback}. Stock DDP Trainer (or accelerate loop) and the same script
with ``gradaccel.hf.enable`` run side by side in each scenario. The last scenario leaves a rank
behind on purpose (a timeout) and ends the run.
"""

import datetime
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
import accelerate  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402

import gradaccel  # noqa: E402
from bench.common import pad_collate  # noqa: E402 (the padding collator the Trainer bench uses)
from gradaccel.recompute.checkpoint import plan_rows, reset_plans  # noqa: E402

A, MICRO, WINDOWS, VOCAB = 4, 2, 3, 64
# The process group's timeout, and so gradaccel's check's. TrainingArguments(ddp_timeout=...) sets it
# on GPUs; on CPU (use_cpu=True) transformers does not pass it on, so main() makes the state first.
TIMEOUT_S = 10
OUT = sys.argv[1] if len(sys.argv) > 1 else "."
RANK = int(os.environ.get("RANK", 0))


def model_dir():
    """A tiny random Llama (hidden 64: bitsandbytes' 4-bit blocks are 64 wide), saved per rank."""
    path = os.path.join(OUT, f"llama{RANK}")
    if not os.path.exists(path):
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       pad_token_id=0, eos_token_id=1, bos_token_id=1)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def data(n=A * MICRO * WINDOWS * 2):
    """Token ids of lengths 3..11: micro-batches, windows and ranks of unequal token counts."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(2, VOCAB, (k,), generator=gen)} for k in lengths]


def load(kind):
    if kind == "qlora":
        quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir(), quantization_config=quant,
                                                                  device_map="cpu")
        model = peft.prepare_model_for_kbit_training(model)  # its defaults: HF checkpointing on
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir())
    if kind in ("lora", "qlora"):
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                                           task_type="CAUSAL_LM"))
    return model


class Counted:
    """Counts the all-reduces this rank calls from Python (gradaccel's) and their elements."""

    def __enter__(self):
        self.calls, self.real = [], dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            self.calls.append(tensor.numel())
            return self.real(tensor, *args, **kwargs)
        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def train(kind, use_gradaccel, out, max_grad_norm=0.05, resume=None, accum=A, hook=None, **kw):
    """A Trainer run: DDP on 2 CPU processes, uneven lengths, accumulation, checkpointing, clipping."""
    model = load(kind)
    args = dict(output_dir=os.path.join(OUT, out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=accum,
                max_steps=WINDOWS, use_cpu=True, ddp_backend="gloo", ddp_timeout=TIMEOUT_S, report_to=[],
                logging_steps=1, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, learning_rate=1e-2,
                gradient_checkpointing=True, max_grad_norm=max_grad_norm)
    if kind == "qlora":
        args.update(optim="paged_adamw_8bit", bf16=True)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**{**args, **kw}),
                                   train_dataset=data(), data_collator=pad_collate)
    if use_gradaccel:
        reset_plans()
        gradaccel.hf.enable(trainer, budget=0.5)
    if hook is not None:
        hook(trainer)
    with Counted() as counted:
        trainer.train(resume_from_checkpoint=resume)
    trainer.all_reduces = counted.calls
    return trainer


def logged(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def close(a, b, what, rel=1e-5):
    assert len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b)), f"{what}: {a} vs {b}"


def assert_params_close(ref, model, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        # Adam turns an entry whose gradient is rounding noise (the window sums and divides by
        # the ranks in another order than DDP's bucket) into a step of ~lr: atol for those.
        torch.testing.assert_close(q.float(), p.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_same_on_every_rank(model):
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    rank0 = flat.clone()
    dist.broadcast(rank0, 0)
    assert torch.equal(flat, rank0), f"rank {RANK}'s parameters differ from rank 0's"


def assert_engaged(trainer, windows=WINDOWS, region="LlamaDecoderLayer.forward"):
    """gradaccel ran on this rank: its optimizer summed the window over the ranks, once per window,
    its checkpoint planned the layers, and accelerate built no DDP."""
    opt = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    assert isinstance(opt, gradaccel.FusedAccumOptimizer) and opt.normalize == "sum"
    assert opt._sync.process_group() is dist.group.WORLD and opt._sync.agreement.window == windows
    assert opt.last_grad_norm is not None and opt.grad_buffer.abs().sum() > 0
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    rows = plan_rows()
    assert rows and {r["region"] for r in rows} == {region}, rows
    # One all-reduce of the whole window buffer per window, none per micro-batch.
    n = opt.grad_buffer.numel()
    assert trainer.all_reduces.count(n) == windows, trainer.all_reduces


def compare(kind, **kw):
    ref = train(kind, False, f"{kind}-stock", **kw)
    assert isinstance(ref.model_wrapped, torch.nn.parallel.DistributedDataParallel)  # stock is DDP
    ours = train(kind, True, f"{kind}-ga", **kw)
    assert_engaged(ours)
    la, lb = logged(ref), logged(ours)
    assert len(la) == WINDOWS
    close([x[0] for x in lb], [x[0] for x in la], "logged loss")
    close([x[1] for x in lb], [x[1] for x in la], "logged grad_norm")
    assert all(x[1] > 0.05 for x in la)  # every window clipped
    assert_params_close(ref.model, ours.model)
    assert_same_on_every_rank(ours.model)
    return ref, ours


def full():
    compare("full")


def lora():
    _, ours = compare("lora")
    assert sum(p.numel() for p in ours.model.parameters() if p.requires_grad) == ours.optimizer.optimizer.grad_buffer.numel()


def qlora():
    import bitsandbytes as bnb
    _, ours = compare("qlora")
    inner = ours.optimizer.optimizer.optimizer  # accelerate's > gradaccel's > bitsandbytes' paged 8-bit AdamW
    assert isinstance(inner, bnb.optim.AdamW) and inner.args.optim_bits == 8 and inner.is_paged
    # Each layer traced once a structure on each rank (with a padding mask, and without one),
    # every other length sized (gemm_4bit included), on each torch.
    counts = [r["lengths"] for r in plan_rows()]
    assert {(c["traced"], c["not_sized"]) for c in counts} == {(1, "")}, counts
    assert max(c["sized"] for c in counts) >= 2, counts


def resume():
    whole = train("full", True, "resume-whole", save_strategy="steps", save_steps=1)
    ckpt = os.path.join(OUT, "resume-whole", "checkpoint-1")
    assert os.path.exists(os.path.join(ckpt, "optimizer.pt"))
    resumed = train("full", True, "resume-again", resume=ckpt)
    assert resumed.state.global_step == WINDOWS
    assert_engaged(resumed, windows=WINDOWS - 1)  # it ran windows 2 and 3
    # The resumed rank replays windows 2 and 3 from the saved state: the same operations.
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item():.3e}"
    assert logged(resumed)[-1] == logged(whole)[-1]


def nonfinite():
    """A NaN on rank 1 only, in window 2: the summed window is NaN on every rank, and every rank
    skips it together (stock DDP Trainer would write NaN into the weights)."""
    def poison(trainer):
        calls = {"n": 0}

        def hook(module, args, output):
            calls["n"] += 1
            if RANK == 1 and calls["n"] == A + 2:
                return output * float("nan")
        trainer.model.lm_head.register_forward_hook(hook)
    ours = train("full", True, "nonfinite", hook=poison)
    opt = ours.optimizer.optimizer
    assert opt.skipped_steps == 1, opt.skipped_steps
    norms = [x[1] for x in logged(ours)]
    assert norms[1] != norms[1] and norms[0] == norms[0] and norms[2] == norms[2], norms
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())
    assert_same_on_every_rank(ours.model)


def _fresh_accelerator():
    accelerate.state.AcceleratorState._reset_state()
    accelerate.state.GradientState._reset_state()
    return accelerate.Accelerator(gradient_accumulation_steps=A, cpu=True)


def accelerate_loop(use_gradaccel, fail_at=None):
    """The accelerate recipe on 2 processes: accumulate(), backward(), clip_grad_norm_()."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir())
    model.activation_checkpointing_enable()
    accelerator = _fresh_accelerator()
    if use_gradaccel:
        reset_plans()
        gradaccel.hf.enable(accelerator, budget=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    model.train()
    gen = torch.Generator().manual_seed(100 + RANK)  # each rank its own data, of its own lengths
    norms = []
    for k in range(A * WINDOWS):
        ids = torch.randint(2, VOCAB, (MICRO, 5 + (3 * k + RANK) % 7), generator=gen)
        if k == fail_at:
            raise ValueError(f"rank {RANK} stops at micro-batch {k}")
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
    return model, opt, norms


def accelerate_run():
    ref, _, ref_norms = accelerate_loop(False)
    assert isinstance(ref, torch.nn.parallel.DistributedDataParallel)
    with Counted() as counted:
        model, opt, norms = accelerate_loop(True)
    assert isinstance(opt.optimizer, gradaccel.FusedAccumOptimizer) and plan_rows()
    assert counted.calls.count(opt.optimizer.grad_buffer.numel()) == WINDOWS
    assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    close(norms, ref_norms, "clip_grad_norm_")
    assert min(norms) > 0.5  # clipped every window
    assert_params_close(ref.module, model)
    assert_same_on_every_rank(model)


def diverge_accumulation():
    """Rank 1 accumulates 3 micro-batches, rank 0 4: both stop at the first window's end, saying so."""
    try:
        train("full", True, "diverge-accum", accum=A if RANK == 0 else A - 1)
    except RuntimeError as e:
        assert "different numbers of micro-batches in window 0" in str(e) and "rank 0: 4, rank 1: 3" in str(e), str(e)
    else:
        raise AssertionError("ranks with different accumulation counts did not fail")


def diverge_raise():
    """Rank 1 raises in window 2 (its forward): rank 0 stops at that window's end with rank 1's error."""
    def boom(trainer):
        calls = {"n": 0}

        def hook(module, args):
            calls["n"] += 1
            if RANK == 1 and calls["n"] == A + 2:
                raise ValueError("boom on rank 1")
        trainer.model.lm_head.register_forward_pre_hook(hook)
    start = time.monotonic()
    try:
        train("full", True, "diverge-raise", hook=boom)
    except (RuntimeError, ValueError) as e:
        if RANK == 1:
            assert isinstance(e, ValueError) and "boom on rank 1" in str(e), str(e)
        else:
            assert "rank 1 failed in window 1 (ValueError: boom on rank 1)" in str(e), str(e)
            assert time.monotonic() - start < TIMEOUT_S  # told, not timed out
    else:
        raise AssertionError("a rank that raised mid-window did not stop the other")


def diverge_timeout():
    """The accelerate loop, where no Trainer tells the others: rank 1 raises mid-window, rank 0 fails
    after the process group's timeout, saying which rank did not come."""
    start = time.monotonic()
    try:
        accelerate_loop(True, fail_at=A + 1 if RANK == 1 else None)
    except (RuntimeError, ValueError) as e:
        if RANK == 0:
            assert "rank(s) [1] did not reach the end of window 1" in str(e), str(e)
            assert time.monotonic() - start < 3 * TIMEOUT_S
        else:
            assert isinstance(e, ValueError) and "stops at micro-batch" in str(e), repr(e)
    else:
        raise AssertionError("a rank that stopped mid-window did not fail the other")


SCENARIOS = {"full": full, "lora": lora, "qlora": qlora, "resume": resume, "nonfinite": nonfinite,
             "accelerate": accelerate_run, "diverge_accumulation": diverge_accumulation,
             "diverge_raise": diverge_raise, "diverge_timeout": diverge_timeout}
LAST = "diverge_timeout"  # leaves rank 0 behind rank 1: no collective after it


def main():
    model_dir()  # before the process group: save_pretrained writes on the main process only
    accelerate.PartialState(cpu=True, backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    results = {}
    for name in only:
        t0 = time.monotonic()
        try:
            SCENARIOS[name]()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        results[name + ".s"] = round(time.monotonic() - t0, 2)
        if name != LAST and dist.is_initialized():
            dist.barrier()
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort a rank in interpreter teardown (see tests/_dist.py)


if __name__ == "__main__":
    main()
