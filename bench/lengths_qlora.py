"""The script this project started from, in small, at every length: TRL's SFTTrainer with its
default collator, a 4-bit (nf4, double-quant) Llama with grouped-query attention, peft LoRA r16
on q/k/v/o, batch 1 (each step its own length), paged 8-bit AdamW, checkpointing on; stock
against ``gradaccel.hf.enable(trainer, budget=0.5)``, each in a process of its own::

    PYTHONPATH=. python bench/lengths_qlora.py            # both variants, then the table
    PYTHONPATH=. python bench/lengths_qlora.py --variant gradaccel-budget0.5 --dropout 0
    PYTHONPATH=. python bench/lengths_qlora.py --device cuda     # bf16, flash-attn where installed (bench/gpu.sh)

The ``lengths`` suite runs :func:`rows` (a tiny model and 4 micro-batches under ``--tiny``). Each variant's
``time`` is the whole ``trainer.train()``; for gradaccel the per-layer counters say how its
regions were planned (``traced``: calls traced; ``sized``: calls at a new length planned from
size formulas with no trace).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SUITE = "lengths"
VARIANTS = ("torch-hf-ckpt", "gradaccel-budget0.5")


def _texts(n: int, lo: int, hi: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, vocab - 2, (k,), generator=gen).tolist()) for k in lengths]


def _tokenizer(vocab: int):
    import tokenizers
    import transformers

    words = {"[PAD]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(vocab - 2)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[PAD]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


def run(variant: str, micro: int, accum: int, dropout: float, hidden: int = 256, layers: int = 4,
        max_len: int = 500, device: str = "cpu") -> dict:
    """One variant in this process: {time, losses, traced, sized, passes, layers}. On CUDA the
    model computes in bf16 with flash-attn's kernels where flash-attn is installed; on CPU in
    fp32 (TRL would turn bf16 autocast on, and this CPU's bf16 GEMMs are many times slower than
    fp32: tests/integrations/test_hf_qlora_lengths.py runs bf16)."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    import gradaccel
    from gradaccel.recompute.state import STATE

    torch.set_num_threads(1)
    vocab = 512
    tok = _tokenizer(vocab)
    path = tempfile.mkdtemp()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    cuda = device.startswith("cuda")
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.bfloat16 if cuda else torch.float32)
    attn = "flash_attention_2" if cuda and _has("flash_attn") else "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, attn_implementation=attn,
                                                              device_map=device)
    model = peft.prepare_model_for_kbit_training(model)
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=micro // accum, per_device_train_batch_size=1,
                         gradient_accumulation_steps=accum, learning_rate=1e-3, optim="paged_adamw_8bit",
                         logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=not cuda,
                         max_length=max_len + 8, seed=0, data_seed=0, bf16=cuda)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           task_type="CAUSAL_LM")
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=tok, peft_config=lora,
                             train_dataset=datasets.Dataset.from_dict({"text": _texts(micro, 5, max_len, vocab)}))
    if variant.startswith("gradaccel"):
        gradaccel.hf.enable(trainer, budget=0.5)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    structures = [s for per in STATE.shapes.values() for s in per.values()]
    return dict(time=seconds, losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
                traced=sum(s.traces for s in structures), sized=sum(s.sized for s in structures),
                passes=sum(s.passes for s in structures), layers=layers)


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _in_process(variant: str, micro: int, accum: int, dropout: float, device: str = "cpu", **kw) -> dict:
    """:func:`run` in a fresh interpreter, as a user starts a script."""
    code = (f"import json, bench.lengths_qlora as q; "
            f"print('RESULT' + json.dumps(q.run({variant!r}, {micro}, {accum}, {dropout}, device={device!r}, **{kw!r})))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT"):])


def rows(quick: bool, device: str) -> list[dict]:
    """The suite's rows: per variant, ``time`` (stock is the baseline), and for gradaccel the
    regions ``traced`` and ``sized`` and the largest loss difference to stock."""
    from bench.common import row

    from bench.common import progress, tiny

    small = dict(hidden=64, layers=2, max_len=40) if tiny() else {}
    micro, accum = (4, 2) if tiny() else (64, 16)
    case = f"qlora-sft gqa r16 batch 1 ({micro} lengths)"
    found = {}
    for i, v in enumerate(VARIANTS, 1):
        progress(f"{case} {v}", i, len(VARIANTS))
        found[v] = _in_process(v, micro, accum, 0.05, device, **small)
    out = [row(SUITE, case, v, "time", r["time"], "s", device) for v, r in found.items()]
    ours = found["gradaccel-budget0.5"]
    ref = found["torch-hf-ckpt"]
    out.append(row(SUITE, case, "gradaccel-budget0.5", "traced_per_layer", ours["traced"] / ours["layers"], "calls", device))
    out.append(row(SUITE, case, "gradaccel-budget0.5", "sized", ours["sized"], "calls", device))
    out.append(row(SUITE, case, "gradaccel-budget0.5", "loss_diff",
                   max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])), "", device))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    for v in [a.variant] if a.variant else VARIANTS:
        r = _in_process(v, a.micro, a.accum, a.dropout, a.device)
        print(f"{v:<22} {r['time']:7.2f} s  traced {r['traced']:4d}  sized {r['sized']:4d}  passes {r['passes']}  "
              f"losses {[round(x, 4) for x in r['losses']]}")


if __name__ == "__main__":
    main()
