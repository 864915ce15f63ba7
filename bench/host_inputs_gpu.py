"""One long-context training step with the blocks' inputs kept on the device, with them on the
host (``checkpoint_blocks(..., inputs_on_host=True)``), and with every block sliced (the whole
block a slice of the sequence at a time, K/V whole: gradaccel/memory/sliced.py, whose attention
runs torch's lower-right causal bias on CUDA) with its input on the host, side by side: measured
peak (``max_memory_allocated``), step time, the fit's predicted peak, and the gradients'
agreement with the first row's (bit-equal for the inputs on the host; for the sliced blocks, the
largest difference over the largest gradient: bf16 sums over slices).

A Llama-3.2-1B-shaped model with random weights, bf16, SDPA, the base model (no LM head: its
logits would set the peak; the loss is the final hidden state's mean square). On a GPU:

    python bench/host_inputs_gpu.py --seq 32768            # under 50 s on an H100/H200 (not yet run)

``--tiny`` runs a small shape on the CPU, to check the script itself.
"""

import argparse
import copy
import time

import torch
import transformers

import gradaccel
from gradaccel.memory.fit import Planner, _evaluate
from gradaccel.memory.parking import HOST, set_parking
from gradaccel.memory.parts import sliced, sliced_count
from gradaccel.memory.profile import find_blocks
from gradaccel.memory.target import set_plans


def _model(tiny: bool, seq: int):
    if tiny:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=seq)
    else:  # Llama-3.2-1B's shape
        cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=seq, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaModel(cfg)


def _step(model, ids, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    sync()
    t0 = time.perf_counter()
    out = model(input_ids=ids).last_hidden_state
    out.float().pow(2).mean().backward()
    sync()
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    return elapsed, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seq = min(args.seq, 512) if args.tiny else args.seq
    base = _model(args.tiny, seq).to(device, dtype).train()
    ids = torch.randint(0, base.config.vocab_size, (1, seq), device=device)
    planner = Planner(base, optim="sgd", dtype=dtype, make_batch=lambda mb, t: {"input_ids": ids[:, :t]},
                      loss_fn=lambda m, b: m(**b).last_hidden_state.float().pow(2).mean())
    prof = planner.profile(seq, 1)  # one fake-tensor profile for the three rows
    plan = sliced(sliced_count(seq))
    rows, grads = [], []
    for name in ("device", "host", plan):
        gradaccel.reset_plans()
        model = copy.deepcopy(base)
        if name == plan:
            points = [prof.piece_point(prof.kind_of[s], plan) for s in range(len(prof.blocks))]
            fit = _evaluate(planner, seq, 1, 1, points, host=True)
            gradaccel.checkpoint_blocks(model, inputs_on_host=True)  # what fit.apply sets, without its optimizer
            blocks = find_blocks(model)
            set_plans(model, blocks, False, fit.budgets)
            set_parking(blocks, (HOST,) * len(blocks))
        else:
            fit = planner.estimate(seq, 1, 1, inputs_on_host=name == "host")
            model = gradaccel.checkpoint_blocks(model, inputs_on_host=name == "host")
        _step(model, ids, device)  # warm-up (kernels, the host pool)
        model.zero_grad()
        elapsed, peak = _step(model, ids, device)
        grads.append([p.grad.float() for p in model.parameters()])
        rows.append((name, elapsed, peak, fit))
        del model
    equal = all(torch.equal(a, b) for a, b in zip(*grads[:2]))
    worst = max(g.abs().max().item() for g in grads[0])
    sliced_err = max((a - b).abs().max().item() for a, b in zip(grads[0], grads[2])) / worst
    print(f"{'blocks':<10} {'seq':>7} {'step s':>8} {'measured peak GiB':>18} {'fit peak GiB':>13} {'host GiB':>9}")
    for name, elapsed, peak, fit in rows:
        print(f"{name:<10} {seq:>7} {elapsed:>8.3f} {peak / 2**30:>18.3f} "
              f"{fit.peak / 2**30:>13.3f} {sum(fit.host.values()) / 2**30:>9.3f}")
    print(f"time host/device {rows[1][1] / rows[0][1]:.3f}x, {plan}/device {rows[2][1] / rows[0][1]:.3f}x; "
          f"gradients with the inputs on the host bit-equal: {equal}; {plan}: largest difference "
          f"{sliced_err:.2e} of the largest gradient")

if __name__ == "__main__":
    main()
