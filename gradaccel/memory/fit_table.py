"""How a fit reads: :meth:`Fit.table`, :meth:`Fit.modes` and :meth:`Fit.summary`
(gradaccel/memory/fit.py), the text that ``python -m gradaccel.fit`` prints.

Every row of the table is aligned on its longest name; the peak's phase is said in words
("backward of block 31"); each option names the call that installs it and the command line's
flag that prints it in full."""

import re

from gradaccel.memory.counter import format_bytes
from gradaccel.memory.parking import describe
from gradaccel.memory.parts import is_nested, is_sliced, slices_of
from gradaccel.memory.profile import KEEP_ALL

__all__ = ["table", "modes", "summary", "phase_words"]

_PHASES = {"pre": "the forward before the first block", "head": "the LM head and loss",
           "tail": "the backward after the first block", "optimizer step": "the optimizer step"}
_BLOCK_PHASE = re.compile(r"\('(fwd|bwd)', (\d+)\)")


def phase_words(phase) -> str:
    """A profile's phase label (``("bwd", 31)``, its ``str``, ``"head"``, ...) in words:
    "backward of block 31"."""
    found = _BLOCK_PHASE.fullmatch(str(phase))
    if found:
        return f"{'forward' if found[1] == 'fwd' else 'backward'} of block {found[2]}"
    return _PHASES.get(str(phase), str(phase))


def table(fit) -> str:
    """The plan and its breakdown, one part a row, the peak's phase in words, then the advice
    (where nothing fits) and the other plans worth knowing, each with how to take it."""
    host = sum(fit.host.values())
    head = [f"micro-batch {fit.micro_batch} x {fit.accum_steps} accumulation steps, sequence {fit.seq}"
            + (", loss in chunks (no whole logits made)" if fit.chunked_loss else "")
            + (f", offload=True ({format_bytes(host)} on host)" if fit.offload else "")
            + (f", block inputs on host ({format_bytes(host)} on host"
               + (f": {describe(fit.parking)})" if fit.parking else ")") if fit.inputs_on_host else "")
            + ("" if fit.fits else "  (DOES NOT FIT)"),
            *([f"DeepSpeed ZeRO-3 over {fit.zero3} ranks: weights, gradient, masters and optimizer state counted "
               f"as this rank's 1/{fit.zero3}, plus the most weights gathered whole at once (a block, or the "
               "embedding or head where larger)"] if fit.zero3 else []),
            f"blocks: {modes(fit)}",
            *(f"parts: {n}" for n in fit.parts_notes),
            f"blocks keep {format_bytes(fit.kept)} beyond their inputs; recompute "
            f"{fit.recompute_flops / 1e12:.2f} TFLOP per micro-batch; step time "
            f"{fit.time:.2f}x of no checkpointing (planner's cost model)"]
    rows = [*fit.parts.items(),
            (f"predicted peak, at {phase_words(fit.phase)}", fit.peak),
            ("allocator slack (reserved, not measured)", fit.slack),
            *((f"host: {name}", value) for name, value in fit.host.items()),
            *((("target", fit.memory),) if fit.memory is not None else ()),
            *((("host budget", fit.host_memory),) if fit.host_note else ())]
    width = max(len(name) for name, _ in rows + [("part", 0)])
    lines = head + [f"{'part':<{width}} {'bytes':>12}"]
    lines += [f"{name:<{width}} {_bytes(value):>12}" + (f"  ({fit.host_note})" if name == "host budget" else "")
              for name, value in rows]
    if fit.context is not None and fit.seq > fit.context:
        lines.append(f"note: {fit.seq} tokens is past the {fit.context} the model was trained to (its config's "
                     "max_position_embeddings): scaling its rope further (YaRN, ...) is the user's choice")
    lines += [f"why: {fit.why}"] if fit.why else []
    lines += [f"note: {n}" for n in fit.notes]
    lines += [f"advice: {s}" for s in fit.suggestions]
    lines += [f"option {k}: {summary(o)}; take it: plan.options[{k - 1}].apply(model, optimizer), "
              f"or --option {k} for its whole table" for k, o in enumerate(fit.options, 1)]
    return "\n".join(lines)


def _bytes(value) -> str:
    return "no limit" if value is None else format_bytes(value)


def modes(fit) -> str:
    """Each block's plan, runs of equal plans together: "0-13: keep up to 1.00 KiB; 14-31: parts"."""
    def name(b):
        n = slices_of(b)
        if is_sliced(b):
            return f"sliced, {n} slices of {-(-fit.seq // n)} tokens, K/V whole"
        if n:
            mlp = "" if n == 1 else f", MLP in {n} slices of {-(-fit.seq // n)} tokens"
            return ("keep nothing, rebuilt as parts" if is_nested(b) else "parts") + mlp
        if b is None or b == KEEP_ALL:
            return "no checkpoint"
        kind, b = b if isinstance(b, tuple) else ("", b)
        return ("offload, " if kind == "offload" or fit.offload else "") + (
            "keep nothing" if b <= 1 else f"keep up to {format_bytes(b)}")
    runs = []
    for i, b in enumerate(fit.budgets):
        if runs and runs[-1][2] == name(b):
            runs[-1][1] = i
        else:
            runs.append([i, i, name(b)])
    return "; ".join((f"{a}" if a == z else f"{a}-{z}") + f": {n}" for a, z, n in runs)


def summary(fit) -> str:
    """One line: micro-batch, offload, predicted device peak, host bytes and step time."""
    host = sum(fit.host.values())
    how = (", offload=True" if fit.offload else "") + (", loss in chunks" if fit.chunked_loss else "") + \
        (", inputs on host" if fit.inputs_on_host else "")
    return (f"micro-batch {fit.micro_batch} x {fit.accum_steps}{how}: "
            f"device peak {format_bytes(fit.peak)}, host {format_bytes(host)}, step time {fit.time:.2f}x")
