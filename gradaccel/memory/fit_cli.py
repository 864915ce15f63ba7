"""``python -m gradaccel.fit``: the fit (gradaccel/memory/fit.py) and the longest sequence that fits
(gradaccel/memory/longest.py) from the command line. Bad input is answered in one line with exit
status 2, as argparse answers a bad option."""

import argparse
import json

import torch

from gradaccel.memory.counter import format_bytes, parse_bytes
from gradaccel.memory.fit import fit
from gradaccel.memory.fixed_parts import OPTIMS
from gradaccel.memory.longest import max_seq
from gradaccel.memory.presets import PRESETS

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")  # one line, argparse's status


def _count(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"--{name} must be an int >= 1, got {text!r}")
        return value
    return parse


def _bytes(name):
    def parse(text):
        try:
            return parse_bytes(text, f"--{name}")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _parser():
    ap = _Parser(prog="python -m gradaccel.fit",
                 description="Plan training to a memory target: micro-batch, accumulation steps and per-block "
                             "checkpoint plans, or (--max-seq) the longest sequence that fits.")
    ap.add_argument("--model", required=True,
                    help="a preset, a config.json (or its folder), or a Hugging Face hub id (its config.json only); "
                         f"presets: {', '.join(PRESETS)}")
    ap.add_argument("--seq", type=_count("seq"), help="tokens per sequence (not with --max-seq)")
    ap.add_argument("--max-seq", action="store_true", help="find the longest sequence that fits, and its plan")
    ap.add_argument("--batch", type=_count("batch"), default=1, help="sequences per optimizer step (default 1)")
    ap.add_argument("--memory", type=_bytes("memory"), required=True, help="device memory, e.g. 24GiB")
    ap.add_argument("--lora", type=_count("lora"), default=None, help="LoRA rank on every linear layer of the blocks")
    ap.add_argument("--load-in-4bit", action="store_true")
    ap.add_argument("--optim", choices=OPTIMS, default="adamw")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--master-weights", action="store_true")
    ap.add_argument("--slack", type=_bytes("slack"), default=None,
                    help="bytes left to the allocator (default 5%% + 512MiB)")
    ap.add_argument("--host-memory", type=_bytes("host-memory"), default=None,
                    help="host memory the plan may pin, e.g. 64GiB (default: this machine's available memory "
                         "less a margin)")
    ap.add_argument("--granule", type=_count("granule"), default=1024,
                    help="with --max-seq: the answer is a multiple of this many tokens (default 1024)")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> int:
    """Runs the command line; returns 0 when the plan fits, 1 when nothing does (2: bad input)."""
    ap = _parser()
    a = ap.parse_args(argv)
    if a.max_seq == (a.seq is not None):
        ap.error("give --seq or --max-seq (one of them)")
    kwargs = dict(optim=a.optim, lora=a.lora, load_in_4bit=a.load_in_4bit, dtype=getattr(torch, a.dtype),
                  master_weights=a.master_weights, slack=a.slack, host_memory=a.host_memory)
    try:
        if a.max_seq:
            result = max_seq(a.model, a.memory, batch=a.batch, granule=a.granule, **kwargs)
        else:
            result = fit(a.model, a.seq, a.batch, a.memory, **kwargs)
    except ValueError as e:  # the library's answer to input it cannot plan (named argument)
        ap.error(str(e).splitlines()[0])
    if a.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
    else:
        if a.max_seq:
            host = sum(result.host.values())
            head = (f"longest sequence that fits in {format_bytes(a.memory)}: {result.seq} tokens "
                    f"(device peak {format_bytes(result.peak)} + slack {format_bytes(result.slack)}, "
                    f"host {format_bytes(host)}, step time {result.time:.2f}x"
                    + (", offload=True" if result.offload else "")
                    + (", block inputs on host" if result.inputs_on_host else "") + ")") if result.fits else \
                f"not even {result.seq} tokens fit in {format_bytes(a.memory)}"
            if result.longer is not None:
                head += f"; at {result.longer[0]} tokens the least peak is {format_bytes(result.longer[1])}"
            if result.host_cost is not None:
                head += (f"; the host budget cost {result.host_cost[0] - result.seq} tokens ({result.host_cost[0]} "
                         f"without it, with {format_bytes(result.host_cost[1])} on host)")
            print(head)
        print(result.table())
    return 0 if result.fits else 1
