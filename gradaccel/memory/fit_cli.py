"""``python -m gradaccel.fit``: the fit (gradaccel/memory/fit.py) and the longest sequence that fits
(gradaccel/memory/longest.py) from the command line. Bad input is answered in one line with exit
status 2, as argparse answers a bad option: a memory needs its unit and at least 1 MiB (``24``
is 24 bytes to the library, never what a user means here)."""

import argparse
import json
import re

import torch

from gradaccel.memory.counter import format_bytes, parse_bytes
from gradaccel.memory.fit import fit
from gradaccel.memory.fixed_parts import OPTIMS
from gradaccel.memory.longest import max_seq
from gradaccel.memory.presets import PRESETS

__all__ = ["main"]

_UNIT = re.compile(r".*[0-9.]\s*[a-zA-Z]+\s*")  # a number then its unit: "24GiB", "6 GB", "512MiB"


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


def _bytes(least=0):
    """Bytes with their unit ("24GiB", "6 GB"), at least ``least``; "0" alone, as nothing needs a unit.
    (argparse names the flag before each message.)"""
    def parse(text):
        zero = text.strip() == "0"
        if not (zero or _UNIT.fullmatch(text)):
            raise argparse.ArgumentTypeError(f"needs a unit, such as 24GiB, 80GB or 512MiB, got {text!r}")
        try:
            value = parse_bytes(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"unknown unit in {text!r}: use B, KB, MB, GB, TB, KiB, MiB, GiB "
                                             "or TiB") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {format_bytes(least)}, got {text!r}")
        return value
    return parse


def _parser():
    ap = _Parser(prog="python -m gradaccel.fit",
                 description="Plan training to a memory target: micro-batch, accumulation steps and per-block "
                             "checkpoint plans, or (--max-seq) the longest sequence that fits. Exit status: 0 when "
                             "the plan fits, 1 when nothing does, 2 on bad input.")
    ap.add_argument("--model", required=True,
                    help="a preset, a config.json (or its folder), or a Hugging Face hub id (its config.json only); "
                         f"presets: {', '.join(PRESETS)}")
    ap.add_argument("--seq", type=_count("seq"), help="tokens per sequence (required, unless --max-seq)")
    ap.add_argument("--max-seq", action="store_true", help="find the longest sequence that fits, and its plan (instead of --seq)")
    ap.add_argument("--batch", type=_count("batch"), default=1, help="sequences per optimizer step (default: 1)")
    ap.add_argument("--memory", type=_bytes(least=1 << 20), required=True,
                    help="the device's memory, with its unit: 24GiB, 80GB (at least 1MiB)")
    ap.add_argument("--lora", type=_count("lora"), default=None,
                    help="LoRA rank on every linear layer of the blocks (default: none, every weight trained)")
    ap.add_argument("--load-in-4bit", action="store_true",
                    help="frozen block weights in nf4, as bitsandbytes stores them (QLoRA; needs --lora; "
                         "default: weights in --dtype)")
    ap.add_argument("--optim", choices=OPTIMS, default="adamw",
                    help="adamw: torch's fused AdamW; adamw8bit, paged_adamw8bit: bitsandbytes' (paged state "
                         "is counted on the host); sgd (default: adamw)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="the weights' dtype (default: bfloat16)")
    ap.add_argument("--master-weights", action="store_true",
                    help="fp32 master copies of bf16/fp16 weights (FusedAccumOptimizer(master_weights=True); "
                         "default: none)")
    ap.add_argument("--slack", type=_bytes(), default=None,
                    help="bytes left to the allocator, with a unit, or 0 (default: 5%% of --memory, plus "
                         "512MiB where --memory is over 4GiB)")
    ap.add_argument("--host-memory", type=_bytes(), default=None,
                    help="host memory the plan may pin (parked block inputs, offloaded activations, paged "
                         "optimizer state), with its unit: 64GiB (default: this machine's available memory less "
                         "10%%, at least 2GiB; the table's 'host budget' line says which)")
    ap.add_argument("--granule", type=_count("granule"), default=1024,
                    help="with --max-seq: the answer is a multiple of this many tokens (default: 1024)")
    ap.add_argument("--option", type=_count("option"), default=None, metavar="K",
                    help="print the K-th of the plan's options (its 'option K:' line) in full, as "
                         "plan.options[K-1].apply() installs it (default: the plan itself)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON (Fit.to_dict()) (default: as a table)")
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
    if a.option is not None:
        if a.option > len(result.options):
            ap.error(f"--option {a.option}: this plan has {len(result.options)} option(s)")
        result = result.options[a.option - 1]
    if a.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
        return 0 if result.fits else 1
    if a.max_seq and a.option is None:
        print(_longest_line(result, a.memory))
    print(result.table())
    return 0 if result.fits else 1


def _longest_line(result, memory) -> str:
    """--max-seq's answer: the longest sequence, its device peak, host bytes and step time."""
    if not result.fits:
        head = f"not even {result.seq} tokens fit in {format_bytes(memory)}"
    else:
        head = (f"longest sequence that fits in {format_bytes(memory)}: {result.seq} tokens "
                f"(device peak {format_bytes(result.peak)} + slack {format_bytes(result.slack)}, "
                f"host {format_bytes(sum(result.host.values()))}, step time {result.time:.2f}x"
                + (", offload=True" if result.offload else "")
                + (", block inputs on host" if result.inputs_on_host else "") + ")")
    if result.longer is not None:
        head += f"; at {result.longer[0]} tokens the least peak is {format_bytes(result.longer[1])}"
    if result.host_cost is not None:
        head += (f"; the host budget cost {result.host_cost[0] - result.seq} tokens ({result.host_cost[0]} "
                 f"without it, with {format_bytes(result.host_cost[1])} on host)")
    return head
