"""Plan training to a memory target: the micro-batch, accumulation steps and per-block
checkpoint plans that fit, the fastest first, predicted before the first step.

    fit = gradaccel.fit.fit("llama-3-8b", seq=2048, batch=64, memory="80GiB")
    print(fit.table())
    model, opt = fit.apply(model, torch.optim.AdamW(model.parameters(), fused=True))

    python -m gradaccel.fit --model llama-3-8b --seq 2048 --batch 64 --memory 24GiB --lora 16 --load-in-4bit

The prediction is one training step's peak, part by part: weights at their storage size, the
fp32 window buffer of ``FusedAccumOptimizer``, the optimizer's state (from a step of the real
optimizer class on fake tensors), the activations each block keeps under its plan and those
outside the blocks, and each phase's working set (measured on fake tensors with the trace and
planner ``gradaccel.checkpoint`` itself uses; see gradaccel/memory/profile.py). The allocator's
slack (rounding, fragmentation, the CUDA context) is not measured: ``slack`` reserves it.

A Hugging Face causal LM's loss may be computed in chunks (``Fit.chunked_loss``, the head mode
of gradaccel/memory/target.py) where its logits would set the peak. Any module whose blocks
``checkpoint_blocks`` finds can be fitted with ``make_batch`` and ``loss_fn``. Plans with
``offload=True`` (host memory for what the budget leaves out) are predicted the same way:
proposed in ``Fit.options`` where they are faster, and the answer itself where only they fit
(never on a CPU device, where the host is the device). Which plan of those that fit is the
answer, and why (``Fit.why``), is gradaccel/memory/fit_choice.py's; the answer itself
(``Fit``: its table, ``apply`` and the checks it makes) is gradaccel/memory/fit_result.py's.
The longest sequence that fits is gradaccel/memory/longest.py's (``max_seq``); the command line
is gradaccel/memory/fit_cli.py's.
"""

import contextlib
import functools

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from gradaccel.memory.chunked_loss import head_flops, install_head, set_head
from gradaccel.memory.counter import check_count, parse_bytes
from gradaccel.memory.fit_check import facts
from gradaccel.memory.fit_choice import choose, faster_option
from gradaccel.memory.fit_result import Fit
from gradaccel.memory.fixed_parts import (OPTIMS, LoRALinear, _period, _suggest, fake_model, hf_step,  # noqa: F401
                                          load_config, static_parts)
from gradaccel.memory.parking import HOST, PARKED, host_budget, layouts
from gradaccel.memory.presets import PRESETS
from gradaccel.memory.parts import is_sliced, slices_of, structure_notes
from gradaccel.memory.profile import Profile, find_blocks
from gradaccel.memory.split import least_peak, least_recompute
from gradaccel.memory import zero3 as _zero3
from gradaccel.recompute.trace import FLOPS_PER_BYTE

__all__ = ["fit", "estimate", "Fit", "Planner", "PRESETS"]

CPU_HOST = ("offload and inputs on the host are not offered: on a CPU device the host is the device, and bytes "
            "moved there are not saved")



class Planner:
    """A model ready to plan for: the module (or the fake one built from a config), the layout
    of its blocks on a shallower profiled copy, its fixed parts, and a profile per input shape
    (made once, reused by every budget asked of it). :func:`estimate` and :func:`fit` build
    one; keep one to ask many questions of the same model.

    Args: as :func:`fit`'s.
    """

    def __init__(self, model, optim="adamw", lora=None, load_in_4bit=False, dtype=torch.bfloat16,
                 master_weights=False, make_batch=None, loss_fn=None, zero3=None, device=None):
        for name, fn in (("make_batch", make_batch), ("loss_fn", loss_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
        if isinstance(model, nn.Module) and make_batch is None and \
                not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
            raise ValueError(f"{type(model).__name__} is not a Hugging Face causal LM: give make_batch "
                             "(micro_batch, seq) -> batch, and loss_fn (model, batch) -> loss if model(**batch).loss "
                             "is not its loss")
        self.make_batch, self.loss_fn = make_batch, loss_fn
        if isinstance(model, nn.Module):
            self.model, self.profiled, self.layout = model, model, None
        else:
            config = load_config(model)
            full = config.num_hidden_layers
            period = _period(config)
            depth = min(full, 2 * period)
            self.model = fake_model(config, dtype, lora=lora, load_in_4bit=load_in_4bit)
            self.profiled = self.model if depth == full else \
                fake_model(config, dtype, layers=depth, lora=lora, load_in_4bit=load_in_4bit)
            self.layout = [i if i < period else period + (i - period) % period for i in range(full)]
            if load_in_4bit and not lora:
                raise ValueError("load_in_4bit needs lora: 4-bit weights are frozen, only adapters train")
        self.blocks = len(find_blocks(self.model))
        self.host_bound = False  # a host budget kept some block's input off the host (Planner.parkings)
        self.zero3 = _zero3.check_ranks(zero3)
        self.static = static_parts(self.model, optim, master_weights, load_in_4bit)
        if self.zero3:
            self.static = _zero3.sharded(self.static, self.model, find_blocks(self.model), self.zero3)
        self.load_in_4bit, self.lora = load_in_4bit, lora
        self.made_for = facts(self)  # what apply() checks the model and optimizer against
        if device is None:  # a real module's own device; a config's (fake weights): an accelerator
            device = next((p.device for p in self.model.parameters() if not isinstance(p, FakeTensor)
                           and not p.is_meta), None)
        self.on_cpu = device is not None and torch.device(device).type == "cpu"
        self.profiles = {}
        self._lengths = {}
        self._kinds_at = {}  # block kinds predicted at one length, shared by the length profiles
        # The loss in chunks (gradaccel/memory/target.py's head mode) is an option for a causal LM
        # with the stock loss, profiled as the model computes it. Its price per token:
        self.head_flops = head_flops(self.profiled) if loss_fn is None else 0

    def profile(self, seq, micro_batch, chunked_loss=False) -> Profile:
        """The profile of one micro-step (``chunked_loss``: with the loss computed in chunks)."""
        key = (seq, micro_batch, chunked_loss)
        if key not in self.profiles:
            if chunked_loss and not self.head_flops:
                raise ValueError("chunked_loss needs a Hugging Face causal LM with its stock loss and no loss_fn")
            if any(getattr(p, "quant_state", None) is not None for p in self.model.parameters()):
                raise ValueError("model holds bitsandbytes 4-bit weights, which cannot be copied onto fake tensors: "
                                 "plan the model before quantising it, with load_in_4bit=True")
            if self.make_batch is None:
                vocab = self.profiled.config.vocab_size
                ids = torch.zeros(micro_batch, seq, dtype=torch.long).random_(0, vocab)
                batch = {"input_ids": ids, "labels": ids}
            else:
                # Only shapes and dtypes matter: the batch is copied onto fake tensors.
                batch = self.make_batch(micro_batch, seq)
            step = hf_step if self.loss_fn is None else functools.partial(_checked_loss, self.loss_fn)
            prepare = functools.partial(_chunk_loss, on=chunked_loss) if self.head_flops else None
            self.profiles[key] = Profile(self.profiled, step, batch, prepare=prepare, trajectories=True)
        return self.profiles[key]

    def lengths(self, seq, micro_batch, chunked_loss=False):
        """The step's profile at every length up to ``seq`` (gradaccel/memory/lengths.py), made from
        profiles at a few lengths (``seq``'s own among them) and kept."""
        from gradaccel.memory.lengths import LengthProfile, profile_lengths

        key = (seq, micro_batch, chunked_loss)
        if key not in self._lengths:
            self._lengths[key] = LengthProfile(lambda t: self.profile(t, micro_batch, chunked_loss),
                                               profile_lengths(seq) or [seq], self._kinds_at)
        return self._lengths[key]

    def fronts(self, prof, offload=False, host=False) -> list:
        """Per block of the model, its kind's plans (``Profile.options``; ``offload``: with offload;
        ``host``: with the inputs on the host, True for every block or a role per block,
        ``Profile.host_options``)."""
        layout = list(self.layout or range(len(prof.blocks)))
        if host is False:
            return [prof.options(prof.kind_of[s], offload) for s in layout]
        roles = (HOST,) * len(layout) if host is True else host
        return [prof.host_options(prof.kind_of[s], offload, r) for s, r in zip(layout, roles)]

    def parkings(self, prof, host) -> list:
        """The parking layouts to plan for ``host``: none (False), every block's input (True), or
        those a host budget in bytes allows (gradaccel/memory/parking.py; True where that is all)."""
        if isinstance(host, bool):
            return [host]
        found = layouts(prof, host, self.layout)
        self.host_bound = self.host_bound or found != [True]
        return found

    def predict(self, prof, points, exact=True) -> dict:
        out = prof.predict(points, exact=exact, layout=self.layout)
        out["transient"] += self._dequantised(prof)
        out["peak"] += self._dequantised(prof)
        return out

    def _dequantised(self, prof) -> int:
        """The 4-bit matmul's backward dequantises one weight at a time: the largest one."""
        if not self.load_in_4bit:
            return 0
        return max((m.weight.numel() * 2 for b in prof.blocks for m in b.modules() if isinstance(m, nn.Linear)),
                   default=0)

    def estimate(self, seq: int, micro_batch: int, budget=None, offload=False, inputs_on_host=False) -> Fit:
        """See :func:`estimate`."""
        prof = self.profile(seq, micro_batch)
        chosen = {}  # kind id -> its point: a block of the model repeats a profiled one
        for kind in prof.kinds:
            b = budget if not isinstance(budget, (list, tuple)) else budget[kind.blocks[0]]
            if b is None or isinstance(b, float):
                b = max(1, int((b or 0.0) * kind.graph.activation_bytes))
            chosen[id(kind)] = kind.offload_at(b) if offload else kind.plan_at(b)
        points = [chosen[id(prof.kind_of[s])] for s in self.layout or range(len(prof.blocks))]
        return _evaluate(self, seq, micro_batch, micro_batch, points, host=inputs_on_host)

    def fit(self, seq: int, batch: int, memory, slack=None, micro_batches=None, host_memory=None) -> Fit:
        """See :func:`fit`."""
        memory, slack = memory_and_slack(memory, slack)
        check_count(batch, "batch"), check_count(seq, "seq")
        budget, host_note = host_budget(host_memory)
        # What the blocks' parked inputs may take: the budget less the paged optimizer state.
        inputs = True if budget is None else max(0, budget - self.static.paged)
        usable = memory - slack
        setup = self
        sizes = sorted(micro_batches or [d for d in range(1, batch + 1) if batch % d == 0])
        # On a CPU device the host is the device: bytes moved to the host are not saved.
        host_ok = not self.on_cpu
        notes = [] if host_ok else [CPU_HOST]

        def within(r):  # its host bytes within the budget
            return budget is None or sum(r.host.values()) <= budget

        def fitting(**how):  # the plans that fit at each micro-batch (either loss), smallest first
            out = []
            for mb in sizes:
                plans = [r for r in _plans_for(setup, seq, mb, batch, usable, **how) if within(r)]
                if not plans:
                    break  # a larger micro-batch needs more
                out += plans
            return out

        def answer(r, fits=True):
            for x in [r] + r.options:
                x.memory, x.slack, x.host_memory, x.host_note = memory, slack, budget, host_note
            r.fits, r.notes, r._planner = fits, notes, self
            return r

        results = fitting()
        if results:
            best = choose(results)  # see gradaccel/memory/fit_choice.py
            if not host_ok:
                return answer(best)
            # Offload: what the budget leaves out goes to host memory where copying beats
            # recomputing; faster at the same device memory, or not at all (its own micro-batches:
            # offload never lowers the floor of a plan that keeps nothing).
            offloaded = [r for r in (_best_for(setup, seq, x.micro_batch, batch, usable, True, x.chunked_loss)
                                     for x in results) if r is not None and r.offload and within(r)]
            # Inputs on the host: more room for what the blocks keep, so maybe less recompute.
            parked = _best_for(setup, seq, best.micro_batch, batch, usable, chunked_loss=best.chunked_loss, host=inputs)
            for option in [min(offloaded, key=lambda r: r.step_cost)] if offloaded else []:
                if faster_option(option, best):
                    best.options.append(option)
            if parked is not None and faster_option(parked, best):
                best.options.append(parked)
            if best.options:
                best.why += ("; the options below are faster but hold host memory, which the fit uses only where no "
                             "plan fits without it (fit.options[i].apply(model, optimizer) takes one)")
            return answer(best)
        # Nothing fits without offload. Where a plan with offload fits, it is the answer (what
        # apply() installs); otherwise the least this step can take, and what would fit.
        worst = _least_either_loss(setup, seq, batch, False)
        if not host_ok:
            worst.suggestions = _suggest(setup, worst, usable, self.lora, self.load_in_4bit)
            return answer(worst, fits=False)
        fits = fitting(offload=True)
        offload = _least_either_loss(setup, seq, batch, True)
        if not fits and offload.offload and offload.peak <= usable and within(offload):
            fits = [offload]  # the split's estimate missed it; the least-peak plan fits exactly
        parked = None
        if not fits:  # the blocks' inputs on the host, where only then a plan fits
            fits = fitting(host=inputs)
            if not fits:
                parked = _least_either_loss(setup, seq, batch, False, host=inputs)
                if parked.peak <= usable:
                    fits = [parked]
        if fits:
            return answer(choose(fits))
        worst.suggestions = _suggest(setup, worst, usable, self.lora, self.load_in_4bit, offload)
        if parked is not None and parked.peak < min(offload.peak, worst.peak):  # the least this step can take, and how
            worst.suggestions += _suggest(setup, worst, usable, self.lora, self.load_in_4bit, parked)[-1:]
        return answer(worst, fits=False)


def _checked_loss(loss_fn, model, batch):
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return the loss as a tensor of one value, got "
                         f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return loss


def _least(setup: Planner, seq, batch, offload, chunked_loss, host=False) -> Fit:
    """The plan whose predicted peak is least, at micro-batch 1 (``host``: inputs on the host,
    as :meth:`Planner.parkings` takes it; of its layouts, the least peak)."""
    prof = setup.profile(seq, 1, chunked_loss)
    out = []
    for roles in setup.parkings(prof, host):
        with _inputs_on_host(prof, roles):
            points = least_peak(prof, setup.fronts(prof, offload, roles), setup.layout)
        out.append(_evaluate(setup, seq, 1, batch, points, chunked_loss=chunked_loss, host=roles))
    return min(out, key=lambda r: r.peak)


def _least_either_loss(setup: Planner, seq, batch, offload, host=False) -> Fit:
    """:func:`_least` with the model's own loss or in chunks (where the model allows it),
    whichever peaks lower."""
    return min((_least(setup, seq, batch, offload, chunked, host) for chunked in {False, bool(setup.head_flops)}),
               key=lambda r: r.peak)


def memory_and_slack(memory, slack=None) -> tuple:
    """``(memory, slack)`` in bytes: ``slack`` (bytes left to the allocator) as given, or by
    default 5 % of ``memory``, plus 512 MiB on a card over 4 GiB."""
    memory = parse_bytes(memory, "memory")
    if slack is None:
        return memory, memory // 20 + (512 << 20 if memory > (4 << 30) else 0)
    return memory, parse_bytes(slack, "slack")


@contextlib.contextmanager
def _inputs_on_host(prof, on):
    """The profile's step terms with the blocks' inputs on the host (``Profile.step_terms``), for a while."""
    was, prof.inputs_on_host = prof.inputs_on_host, on
    try:
        yield
    finally:
        prof.inputs_on_host = was


def _chunk_loss(model, on):
    install_head(model)
    set_head(model, on)


def _evaluate(setup: Planner, seq, micro_batch, batch, points, exact=True, chunked_loss=False, host=False) -> Fit:
    """``points``: the plan of each block of the model; ``host``: their inputs on the host (True,
    or each block's role: gradaccel/memory/parking.py)."""
    prof = setup.profile(seq, micro_batch, chunked_loss)
    with _inputs_on_host(prof, host):
        pred = setup.predict(prof, points, exact)
    st = setup.static
    step = max(pred["peak"], st.step)
    head = setup.head_flops * micro_batch * seq if chunked_loss else 0  # each chunk's logits again
    recompute = sum(p.cost for p in points) + head
    layout = setup.layout or range(len(prof.blocks))
    measured = sum(p.copy for p in points)  # offload's copies and the inputs' are priced at a measured speed
    if host:  # the copies' time that the blocks' compute does not hide
        exposed = prof.copy_exposed(setup.layout)
        recompute += exposed
        measured += exposed
    forward = sum(prof.kind_of[s].forward_cost for s in layout)
    fold = FLOPS_PER_BYTE["cpu"] * 10 * st.trainable  # reading a grad and updating the fp32 buffer
    base = 3 * forward + fold
    if st.ranks:
        parts = _zero3.parts(st)
    else:
        parts = {"weights": st.weights, "window buffer (fp32 grads)": st.buffer, "optimizer state": st.state}
        if st.masters:
            parts["fp32 master weights"] = st.masters
    if pred["peak"] >= st.step:
        parts["block activations held"] = pred["blocks"]
        parts["other activations and grads (embeddings, logits, loss)"] = pred["outside"]
        parts["working set of the peak phase (recompute, grads)"] = pred["transient"]
        phase = pred["phase"]
    else:
        parts["optimizer update working set"] = st.step
        phase = "optimizer step"
    roles, host = host, {"optimizer state, paged (bitsandbytes)": st.paged} if st.paged else {}
    offloaded = sum(p.host for p in points)
    if offloaded:
        host["activations offloaded by the blocks"] = offloaded
    if roles is not False:
        with _inputs_on_host(prof, roles):
            parked = [r in PARKED for r in prof.roles(len(layout))]
        host["block inputs (inputs_on_host)"] = sum(prof.parked_bytes(s) for s, on in zip(layout, parked) if on)
    notes = list(dict.fromkeys(n for s, p in zip(layout, points) if slices_of(p.budget) > 0 and not is_sliced(p.budget)
                               for n in structure_notes(prof.blocks[s])))
    return Fit(seq, micro_batch, batch // micro_batch, [p.budget for p in points], sum(p.kept for p in points),
               st.total + step, parts, str(phase), (base + recompute) / base,
               sum(p.flops for p in points) + head,
               (batch // micro_batch) * (base + recompute), (batch // micro_batch) * measured, host=host,
               offload=bool(offloaded), chunked_loss=chunked_loss, inputs_on_host=roles is not False, parts_notes=notes,
               made_for=setup.made_for, zero3=setup.zero3, parking=None if isinstance(roles, bool) else tuple(roles),
               context=getattr(getattr(setup.model, "config", None), "max_position_embeddings", None))


def estimate(model, seq: int, micro_batch: int, budget=None, *, optim="adamw", lora=None, load_in_4bit=False,
             dtype=torch.bfloat16, master_weights=False, make_batch=None, loss_fn=None, offload=False,
             inputs_on_host=False, zero3=None) -> Fit:
    """The predicted peak of a training step with a given micro-batch and checkpoint budget.

    Args:
        model: an ``nn.Module`` (real or fake tensors; not run), a preset name, a config.json
            path or a transformers config (built on fake tensors, in ``dtype``).
        seq, micro_batch: the input shape ``(micro_batch, seq)`` of token ids.
        budget: per block, as ``checkpoint_blocks``'s: an int of bytes, or a fraction (None and
            0.0 are predicted as gradaccel's keep-nothing plan, a 1-byte budget), or a list of
            int budgets, one per block.
        optim, lora, load_in_4bit, master_weights, make_batch, loss_fn: as for :func:`fit`.
        offload: the blocks' plans with ``gradaccel.checkpoint(..., offload=True)``.
        inputs_on_host: the blocks' inputs wait on the host between forward and backward
            (``checkpoint_blocks(..., inputs_on_host=True)``): stated in ``host``.
        zero3: as for :func:`fit`.

    Returns:
        Fit: ``peak`` and ``parts`` (accumulation steps 1).
    """
    return Planner(model, optim, lora, load_in_4bit, dtype, master_weights, make_batch,
                   loss_fn, zero3=zero3).estimate(seq, micro_batch, budget, offload, inputs_on_host)


def _plans_for(setup: Planner, seq, micro_batch, batch, usable, offload=False, host=False) -> list:
    """The fastest plans at this micro-batch that fit (:func:`_best_for`): with the model's loss,
    and with the loss in chunks where the model allows it and the model's loss does not fit or
    peaks at the loss."""
    plain = _best_for(setup, seq, micro_batch, batch, usable, offload, False, host)
    plans = [] if plain is None else [plain]
    if setup.head_flops and (plain is None or plain.phase == "head"):
        plans += [r for r in (_best_for(setup, seq, micro_batch, batch, usable, offload, True, host),) if r is not None]
    return plans


def _best_for(setup: Planner, seq, micro_batch, batch, usable, offload=False, chunked_loss=False, host=False) -> Fit | None:
    """The fastest plan at this micro-batch whose predicted peak fits ``usable`` bytes (with
    ``offload``: among the plans of ``gradaccel.checkpoint(..., offload=True)``; ``chunked_loss``:
    the loss in chunks; ``host``: the blocks' inputs on the host, as :meth:`Planner.parkings`
    takes it, the fastest of its layouts)."""
    prof = setup.profile(seq, micro_batch, chunked_loss)
    room = usable - setup.static.total - setup._dequantised(prof)  # for the step's activations
    if setup.static.step > room:
        return None
    best = None
    for roles in setup.parkings(prof, host):
        with _inputs_on_host(prof, roles):
            points = least_recompute(prof, setup.fronts(prof, offload, roles), room, layout=setup.layout)
        if points is None:
            continue
        result = _evaluate(setup, seq, micro_batch, batch, points, chunked_loss=chunked_loss, host=roles)
        if result.peak <= usable and (best is None or result.step_cost < best.step_cost):
            best = result
    return best


def fit(model, seq: int, batch: int, memory, *, optim="adamw", lora=None, load_in_4bit=False,
        dtype=torch.bfloat16, master_weights=False, slack=None, micro_batches=None, make_batch=None,
        loss_fn=None, zero3=None, device=None, host_memory=None) -> Fit:
    """The fastest way to train ``batch`` sequences of ``seq`` tokens per step in ``memory``.

    Tries micro-batch sizes that divide ``batch`` (or ``micro_batches``); for each, the
    per-block plans with the least recompute whose predicted peak fits (gradaccel/memory/split.py),
    with the causal LM loss as the model computes it or, where that does not fit or the peak is
    at the loss, computed in chunks without the whole logits (``chunked_loss``: one
    more LM-head matmul in backward; Hugging Face causal LMs with the stock loss), and picks
    the configuration with the least predicted step time (the planner's cost model:
    forward and backward, recompute, and the per-micro-batch fold into the fp32 buffer).

    Args:
        model: an ``nn.Module`` (profiled on fake tensors, not run): a Hugging Face causal LM,
            or any module whose repeated blocks ``checkpoint_blocks`` finds, with
            ``make_batch``; or a preset name (``gradaccel.memory.fit.PRESETS``), a config.json path
            or a config.
        seq: tokens per sequence. batch: sequences per optimizer step (the effective batch).
        memory: the device's memory for this process: bytes or a string such as "24GiB".
        optim: "adamw" (torch's fused AdamW), "adamw8bit" or "paged_adamw8bit" (bitsandbytes),
            "sgd", or an optimizer (its class is stepped once on fake tensors and its state
            measured; bitsandbytes' too). Paged state (bitsandbytes puts tensors of 100k values
            or more in unified memory on CUDA) is reported apart, in ``host``: it is not in
            the device peak, as the driver moves it to host memory when the device is short.
        lora: LoRA rank on every linear layer of the blocks (models built from a config).
        load_in_4bit: frozen block weights stored as nf4 (bitsandbytes, double quantisation),
            sized as bitsandbytes' quantize_4bit stores them (``fixed_parts.nf4_bytes``). A module already
            quantised has its real storage counted but cannot be profiled: plan it before.
        dtype: weights' dtype for a model built from a config.
        master_weights: fp32 master copies of bf16/fp16 parameters (FusedAccumOptimizer).
        slack: bytes to leave for the allocator (rounding, fragmentation, CUDA context);
            default 5% of ``memory``, plus 512 MiB where ``memory`` is over 4 GiB.
        micro_batches: micro-batch sizes to try (default: the divisors of ``batch``).
        make_batch: ``make_batch(micro_batch, seq) -> batch``, one micro-batch as ``loss_fn``
            takes it (any nesting of tensors; only shapes and dtypes are used). Needed for a
            module that is not a Hugging Face causal LM; default: token ids and labels.
        loss_fn: ``loss_fn(model, batch) -> loss``, one micro-step's forward up to the scalar
            loss; default ``model(**batch, use_cache=False).loss``.
        zero3: the number of ranks DeepSpeed ZeRO-3 shards the model over (``gradaccel.hf.enable``
            under a ZeRO-3 Trainer), or None: each rank holds 1/N of the weights, of the fp32
            gradient partition and masters, and of the optimizer state, plus one block's weights
            gathered whole (or the embedding's or head's, where larger: gradaccel/memory/zero3.py);
            ``memory`` is one rank's device.
        device: the device training runs on (``"cuda"``, ``"cpu"``, a ``torch.device``); default
            a module's own, and an accelerator for a preset or a config. On a CPU device the
            host is the device: plans with offload or the inputs on the host save nothing there,
            and are not offered (``notes`` says so).
        host_memory: the host memory the plan may pin (parked block inputs, offloaded
            activations, paged optimizer state): bytes or a string such as "64GiB"; default this
            machine's available memory less a margin (gradaccel/memory/parking.py), stated in the
            table; ``float("inf")`` for no limit. Where parking every block's input would go over
            it, the fit parks fewer, or nests two blocks under one parked input, whichever
            recomputes less (``Fit.parking``).

    Returns:
        Fit: micro-batch, accumulation steps, per-block budgets, predicted peak with its parts
        and step time; ``fits`` False (with ``suggestions``) when nothing fits. ``options``
        holds the fastest plan with offload (``gradaccel.checkpoint(..., offload=True)``: the
        checkpoint's own planner chooses, per block, what goes to host memory where copying
        beats recomputing) when it is faster within the same memory, with its device peak
        and, in ``host``, its host bytes. Its device peak is measured as the others are, on
        fake tensors with a store that keeps host copies off the device. Where only a plan with
        offload fits, that plan is the answer itself (``offload`` True, ``fits`` True; what
        ``apply()`` installs). Where nothing fits, ``suggestions`` give the least plan with
        offload (its device peak and host bytes, and by how much it is short). ``why`` says
        what the answer was chosen over, and the reason (gradaccel/memory/fit_choice.py: the
        least predicted time per optimizer step; within the noise of a measured copy speed,
        the lower peak; within 0.5%, the larger micro-batch). ``apply()`` checks the model and
        optimizer against what the plan was made for (``made_for``), and refuses a plan that
        does not fit unless ``force=True``.
    """
    planner = Planner(model, optim, lora, load_in_4bit, dtype, master_weights, make_batch, loss_fn,
                      zero3=zero3, device=device)
    return planner.fit(seq, batch, memory, slack=slack, micro_batches=micro_batches, host_memory=host_memory)
