"""The longest context gradaccel.fit predicts a card allows (docs/fit.md's table).

    python -m bench.fit_longest [--case qlora-8b,full-1b] [--memory 24GiB,48GiB,80GiB] [--host 2x]
                                [--at 65536:24GiB]

Cases (batch 1, bf16 weights, gradaccel.fit.max_seq to 1024 tokens):

- ``qlora-8b``: llama-3.1-8b, LoRA r16 on every linear layer of the blocks over nf4 weights,
  paged 8-bit AdamW (bitsandbytes);
- ``full-1b``: llama-3.2-1b, full fine-tune, torch's fused AdamW.

Per case and memory: the longest sequence, its plan's device peak, the host memory it uses and
the host budget it was fitted to (``--host``: a multiple of the card's memory, "2x" by default,
a machine with twice its GPU's memory in RAM; or bytes per memory, comma-separated), the tokens
the budget cost where it bound, the modelled step time and blocks' modes, and what the peak is
made of. ``--at LENGTH:MEMORY`` also prints the fit at a given length (what dominates the peak
where it does not fit). Predictions on fake tensors, nothing measured: no stock baseline to run
beside them.
"""

import argparse
import json
import sys
import time

from gradaccel.memory.counter import format_bytes, parse_bytes
from gradaccel.memory.fit import Planner
from gradaccel.memory.longest import longest
from gradaccel.memory.parking import describe

CASES = {
    "qlora-8b": dict(model="llama-3.1-8b", optim="paged_adamw8bit", lora=16, load_in_4bit=True),
    "full-1b": dict(model="llama-3.2-1b", optim="adamw"),
}


def _row(case, memory, r, seconds):
    host = sum(r.host.values())
    top = sorted(r.parts.items(), key=lambda kv: -kv[1])[:3]
    return {"case": case, "memory": memory, "seq": r.seq if r.fits else 0, "fits": r.fits,
            "peak": r.peak, "slack": r.slack, "host": host, "host_budget": r.host_memory, "host_cost": r.host_cost,
            "parking": r.parking, "time": round(r.time, 3), "offload": r.offload,
            "chunked_loss": r.chunked_loss, "modes": r.modes() + (f"; inputs: {describe(r.parking)}" if r.parking else ""),
            "phase": r.phase,
            "top_parts": [(k, v) for k, v in top], "longer": r.longer, "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fit_longest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default=",".join(CASES))
    ap.add_argument("--memory", default="24GiB,48GiB,80GiB")
    ap.add_argument("--host", default="2x", help="host budget: a multiple of the card's memory (2x), or bytes per "
                                                  "memory, comma-separated")
    ap.add_argument("--at", default="", help="LENGTH:MEMORY,... fits to print at given lengths (first case)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    rows = []
    for case in a.case.split(","):
        spec = dict(CASES[case])
        planner = Planner(spec.pop("model"), **spec)
        mems = a.memory.split(",")
        hosts = [f"{float(a.host[:-1]) * parse_bytes(m) / 2**30:g}GiB" for m in mems] if a.host.endswith("x") \
            else a.host.split(",")
        for mem, host in zip(mems, hosts):
            t0 = time.perf_counter()
            r = longest(planner, mem, host_memory=host)
            rows.append(_row(case, mem, r, time.perf_counter() - t0))
            print(json.dumps(rows[-1], default=str), flush=True)
            print(r.table(), flush=True)
        for probe in filter(None, a.at.split(",")):
            length, mem = probe.split(":")
            r = planner.fit(int(length), 1, parse_bytes(mem), host_memory=2 * parse_bytes(mem))
            print(f"== {case} at {length} tokens in {mem}: {'fits' if r.fits else 'does not fit'}", flush=True)
            print(r.table(), flush=True)
        a.at = ""  # the probes are for the first case
    print("\n| case | memory | longest sequence | device peak (+ slack) | host used (budget) | step time | blocks |")
    print("|---|---|---:|---:|---:|---:|---|")
    for x in rows:
        cost = "" if not x["host_cost"] else f"; {x['host_cost'][0]:,} without the budget"
        print(f"| {x['case']} | {x['memory']} | {x['seq']:,}{cost} | {format_bytes(x['peak'])} (+ {format_bytes(x['slack'])}) "
              f"| {format_bytes(x['host'])} ({format_bytes(x['host_budget'])}) | {x['time']:.2f}x | {x['modes']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
