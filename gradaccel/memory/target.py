"""``checkpoint_blocks(model, memory=...)``: one memory target for a training step, reached
below what per-block checkpoints can reach.

``memory`` is the most bytes one training step (forward and backward) may add above what
exists before it: the activations held for backward, backward's working set, and the
parameters' gradients, as :class:`gradaccel.memory.LiveBytes` counts them. At the first
training call for an input shape the model is profiled on fake tensors (gradaccel/memory/profile.py:
nothing allocated), and each block's plan is chosen so that the step's predicted peak
(``Profile.predict``) fits with the least recompute, on the peak's own terms
(gradaccel/memory/split.py: what a block keeps is paid at every later phase, so the last blocks
keep more, and a block rebuilt with a larger working set makes the blocks before it keep less).
A block may run:

- a checkpoint plan at some budget (``gradaccel.checkpoint``'s planner), or no checkpoint where
  its plan would recompute nothing (the same memory, without the checkpoint's own cost);
- **parts**: uncheckpointed, each of its direct children (attention, MLP, norms) a keep-nothing
  checkpoint of its own. It recomputes what keep-least does and holds its parts' inputs instead
  of one, but backward rebuilds one part at a time, not the whole block at once while every
  gradient made so far is alive: below keep-least's floor, that working set is what counts;
- **tiles** (``"tiles:n"``): parts, with each token-wise part (an MLP of linear layers, with
  its norm where that is safe) ``n`` slices of the tokens at a time, each its own checkpoint:
  backward rebuilds one slice's intermediates at once. ``n`` is the split's choice among a few
  (gradaccel/memory/parts.py's ``slice_counts``); of plans that recompute the same, the one
  with the lower predicted peak is taken.
  In both, a norm whose output only feeds the next part runs inside that part's checkpoint
  (gradaccel/memory/parts.py), so the block holds its residual stream's inputs, not each part's.
- **sliced** (``"sliced:n"``, gradaccel/memory/sliced.py): for a Llama-family decoder layer,
  the whole block ``n`` slices of the sequence at a time, keys and values whole: it holds its
  input alone between forward and backward, and its backward a slice of every other tensor.

And where the model's loss does not fit or the peak is at the loss, **head**: for a Hugging
Face causal LM whose loss is the stock ``ForCausalLMLoss``, the loss is computed by
:class:`ChunkedLinearCrossEntropy` from the final hidden states and the LM head's weight, rows
at a time, in forward and again in backward (one more LM-head matmul, priced as such): the
whole logits are never made. The training call's ``outputs.logits`` is then a stand-in that
raises when read (gradaccel/memory/chunked_loss.py); calls without labels get real logits.

Where nothing fits with the blocks' inputs on the device, **host**: every checkpointed block's
input waits in host memory between its forward and its backward (gradaccel/recompute/host_inputs.py),
priced by the profile's step terms (``Profile.inputs_on_host``); ``checkpoint_blocks(...,
inputs_on_host=True)`` plans with it always.

The choice is made once per input shape; outputs and gradients are those without
checkpointing (up to the order of floating-point sums). ``gradaccel.fit`` plans with the same
choices.
"""

import copy
import dataclasses
import threading
import warnings

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from gradaccel.memory import zero3
from gradaccel.memory.fixed_parts import unpacked
from gradaccel.memory.chunked_loss import head_flops, install_head, set_head
from gradaccel.memory.parts import install_parts, set_parts, slices_of
from gradaccel.memory.parking import DEVICE, HOST, check_roles, host_budget, layouts, parked_plan
from gradaccel.memory.sliced import install_sliced
from gradaccel.memory.lengths import LengthProfile, at_length, length_of, profile_lengths
from gradaccel.memory.profile import KEEP_ALL, Profile, find_blocks
from gradaccel.memory.split import least_peak, least_recompute, uncheckpointed
from gradaccel.recompute import compiled
from gradaccel.recompute.block_plan import BlockPlan, Mode, plan_of, set_plan

__all__ = ["MemoryTarget", "set_plans"]

SEEN = 1024  # input shapes whose plan memory= keeps; past it, the oldest goes
PREDICT_LENGTHS = True  # False: profile each new input shape on fake tensors (before 2026-12; for bench/)
_busy = threading.local()
_EVERYTHING = 1 << 62  # a byte budget no region reaches


# -- the target ---------------------------------------------------------------------------------
def _loss_of(out):
    """The scalar a fake step backpropagates: the model's ``loss``, else its output summed (a
    stand-in for a loss computed outside the model)."""
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(loss, dict) or not torch.is_tensor(loss):
            loss = tree_flatten(out)[0][0]
    return loss if loss.dim() == 0 else loss.float().sum()


def _step(model, batch):
    args, kwargs = batch
    with unpacked():  # as fit's hf_step: no dense mask that only fake tensors would make
        return _loss_of(model(*args, **kwargs))


def set_plans(model: nn.Module, blocks: list, chunked_loss: bool, settings: list, roles=None,
              policies=None) -> None:
    """Gives each of ``model``'s checkpointed ``blocks`` its plan (one ``BlockPlan`` each,
    gradaccel/recompute/block_plan.py), and turns the loss in chunks on or off (the head must be
    installed to turn it on).

    Args:
        settings: per block, a setting ``BlockPlan.parse`` reads: an int budget, None
            (uncheckpointed), ``"parts"`` / ``"tiles:n"`` / ``"nested:n"`` / ``"sliced:n"``.
        roles: per block, where its input waits (gradaccel/memory/parking.py); None: as it was
            (a Hugging Face layer's first plan: as ``checkpoint_blocks`` was told).
        policies: per block, its plan's policy under torch.compile (gradaccel/recompute/compiled.py).
    """
    roles = None if roles is None else check_roles(roles, len(blocks))
    for i, (block, s) in enumerate(zip(blocks, settings)):
        run = BlockPlan.parse(s)
        set_parts(block, run.as_parts, run.slices)
        if run.mode is Mode.SLICED:
            install_sliced(block)
        plan = (plan_of(block) or BlockPlan()).run_as(run)
        if roles is not None:
            block.__dict__.pop("_gradaccel_pending", None)
            plan = parked_plan(plan, blocks, i, roles[i])
        if policies is not None and policies[i] is not None:
            plan = dataclasses.replace(plan, policy=policies[i])
        set_plan(block, plan)
    set_head(model, chunked_loss)


class MemoryTarget:
    """``checkpoint_blocks(memory=...)``'s forward pre-hook: picks, per input shape, the plan
    with the least recompute whose step peak fits ``memory`` (see the module docstring).

    Attributes:
        memory: the target in bytes.
        seq: the longest length the first call profiles for, or None (the call's own).
        chosen: input signature -> ``(mode, predicted peak, floor)``; mode is ``"blocks"`` when
            every block runs a checkpoint plan (or none) and the loss is the model's, else a
            tuple of what the plan also uses: ``"parts"`` (blocks run as their parts),
            ``"tiles"`` (MLPs a slice of tokens at a time), ``"nested"`` (blocks checkpointed
            whole around their parts), ``"sliced"`` (whole blocks a slice of the sequence at a
            time, K/V whole), ``"head"`` (the loss in chunks), ``"host"`` (the blocks' inputs on
            the host);
            ``floor`` is the predicted peak with every block at its keep-least plan and the
            model's loss, the least per-block checkpoints reach.
    """

    def __init__(self, memory: int, blocks: list, model: nn.Module, seq: int | None = None, inputs_on_host=False,
                 host_memory=None):
        self.memory, self.seq = memory, seq
        # DeepSpeed ZeRO-3: what the step gathers whole at once, which the profile does not make
        # (gradaccel/memory/zero3.py); found at the first training call, once the engine has sharded.
        self.gathered = None
        self.inputs_on_host = inputs_on_host  # the user's: every plan with the inputs on the host
        # What the parked inputs may take (gradaccel/memory/parking.py): default, the machine's.
        self.host_memory, self.host_note = host_budget(host_memory)
        self.seen = {}
        self.chosen = {}
        self.hosts = {}  # input signature -> where its plan has the blocks' inputs wait (_plan's roles)
        self.policies = {}  # input signature -> per block, its plan's policy under torch.compile (or None)
        self.longest = 0  # the longest length seen (under torch.compile, every length runs its plan)
        self.lengths = {}  # structure key -> LengthProfile (gradaccel/memory/lengths.py)
        self.first = {}  # structure key -> the first length it was called at
        self.kinds_at = {}  # block kinds predicted at the length being planned (LengthProfile's shared)
        self.above = {}  # (structure, profiled length, host) -> the plan there, for lengths just below it
        for b in blocks:
            install_parts(b)
            if seq is not None:  # lengths will vary: a block's region finds its size formulas when first traced
                b._gradaccel_lengths = True
        self.has_head = install_head(model)
        # Without seq, lengths past the profiled range each cost a fake-tensor profile: the range
        # grows ahead of the data, to the next power of two past twice the longest length seen,
        # and no further than the positions the model has.
        self.max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)

    def __deepcopy__(self, memo):
        # A copy of the model plans for itself. Its profiles hold fake copies of the model: a
        # deep copy would copy every one of them (and the profiler copies the model each run).
        new = copy.copy(self)
        new.seen, new.chosen, new.lengths, new.first, new.kinds_at, new.hosts, new.above = {}, {}, {}, {}, {}, {}, {}
        new.policies, new.longest = {}, 0
        return new

    def __call__(self, module, args, kwargs):
        return self._prepare(module, args, kwargs, torch.compiler.is_compiling())

    @torch._disable_dynamo  # under torch.compile it runs eagerly (a graph break before the model's first op)
    def _prepare(self, module, args, kwargs, compiling):
        if getattr(_busy, "on", False) or not (module.training and torch.is_grad_enabled()):
            return None

        if compiling:  # the plan of the longest length the compiled graph serves (see _longest)
            args, kwargs = self._longest(args, kwargs)
        key = _key(args, kwargs)
        blocks = find_blocks(module)
        if self.gathered is None:
            self.gathered = zero3.gathered_at_once(module, blocks) if zero3.is_sharded(module) else 0
        start = False
        if key not in self.seen:
            self._set(module, blocks, False, [0] * len(blocks))
            length, structure = length_of(tree_flatten((args, kwargs))[0])
            new = structure is not None and (structure, False) not in self.lengths
            _busy.on = True
            try:
                self.seen[key], self.chosen[key] = self._choose(module, args, kwargs)
                start = new and self.seq is not None
                if start:
                    # The range up to seq is profiled at this first call, not mid-training: the
                    # step with the loss in chunks too (its own structure, four lengths), which
                    # some length may need, and the longest length is planned.
                    if self.has_head and torch.is_tensor(kwargs.get("labels")):
                        self._profile(module, args, kwargs, True)
                    if length < self.seq:
                        a, kw = at_length((args, kwargs), length, self.seq)
                        self.seen[_key(a, kw)], self.chosen[_key(a, kw)] = self._choose(module, a, kw)
            finally:
                _busy.on = False
                torch.clear_autocast_cache()
            for cache in (self.seen, self.chosen, self.hosts, self.policies):  # one per length: the oldest go first
                while len(cache) > SEEN:
                    cache.pop(next(iter(cache)))
        head, settings = self.seen[key]
        host = self.hosts.get(key, False)
        if start and not compiling:
            # A block that needs no checkpoint at this length runs this one call checkpointed
            # (a byte budget, as memory= sets them, that keeps everything): its region is traced,
            # with its size formulas, now, not at the first length that needs a checkpoint, in
            # the middle of training.
            settings = [_EVERYTHING if s is None else s for s in settings]
        # The loss computed outside the model (no labels): logits as they are.
        # Under compile, each block's plan as compile runs it (dynamo guards on these objects).
        self._set(module, blocks, head and kwargs.get("labels") is not None, settings, host,
                  self.policies.get(key) if compiling else None)
        return None

    def _longest(self, args, kwargs):
        """Under torch.compile: the call at the longest length a compiled graph serves (``seq``,
        else the longest seen so far), whose plan every length runs. What a plan keeps shrinks
        with the length, so the target holds at every shorter one, and one graph serves them all
        (with dynamic shapes): compile recompiles no more often than without gradaccel, where a
        plan per length would recompile at each length whose plan differs."""
        length, _ = length_of(tree_flatten((args, kwargs))[0])
        if length is None:
            return args, kwargs
        self.longest = max(self.longest, length)
        top = max(self.seq or 0, self.longest)
        return (args, kwargs) if top == length else at_length((args, kwargs), length, top)

    def _profile(self, module, args, kwargs, head, predict=True):
        """The step's profile at this call's length: predicted from the structure's profiles
        at other lengths (gradaccel/memory/lengths.py) where it can be, else a fake-tensor run."""
        def run(a, kw, chunked=head):
            return Profile(module, _step, (a, kw), grad_hooks=False, prepare=lambda m: set_head(m, chunked),
                           trajectories=True)

        length, structure = length_of(tree_flatten((args, kwargs))[0])
        if length is None or not PREDICT_LENGTHS or not predict:
            return run(args, kwargs)
        # The loss in chunks is its own structure; where its number of chunks follows the length
        # (a large vocabulary), the fit fails and each length is profiled.
        structure = (structure, head)
        lp = self.lengths.get(structure)
        if lp is None:
            # Without seq, the first length of a structure is profiled alone: data of one length
            # (packed, or padded to a fixed length) never needs more. The second length profiles
            # the range that holds both.
            first = self.first.setdefault(structure, length)
            if self.seq is None and first == length:
                return run(args, kwargs)
            self._past_seq(length)
            lengths = profile_lengths(self.seq or self._ahead(max(length, first)))
            if lengths is None:
                return run(args, kwargs)
            lp = self._range(structure, lengths, lambda t: run(*at_length((args, kwargs), length, t)))
            for b in find_blocks(module):
                # Lengths vary: a block region's size formulas are found when it is traced (now, at
                # the start of training), not at its first other length, mid-training.
                b._gradaccel_lengths = True
            if not head and self.has_head and torch.is_tensor(kwargs.get("labels")) and \
                    (structure[0], True) not in self.lengths:
                # Ahead of need: the step with the loss in chunks (its own structure), which a length
                # near the top of the range may need, is profiled with it, not at that length's step.
                self._range((structure[0], True), lengths,
                            lambda t: run(*at_length((args, kwargs), length, t), chunked=True))
        try:
            if lp.failed is None and not lp.covers(length):
                self._past_seq(length)
                # One fake-tensor run, checked against the fit: covered from now on.
                lp.extend(self._ahead(length) if self.seq is None and length > lp.lengths[-1] else length)
            if lp.covers(length):
                return lp.at(length)
        except Exception as e:  # noqa: BLE001 (a length the fit cannot predict: profiled itself)
            lp.failed = repr(e)
        return run(args, kwargs)

    def _range(self, structure, lengths: list, make):
        """The length profile of ``structure`` over ``lengths`` (``make(t)``: the profile at ``t``), kept."""
        try:
            lp = LengthProfile(make, lengths, self.kinds_at)
        except Exception as e:  # the model does not run at other lengths: per length, as before
            lp = _Unprofiled(repr(e))
        self.lengths[structure] = lp
        if lp.failed is not None:
            warnings.warn(f"gradaccel.checkpoint_blocks(memory=...): the step's profile is not predicted across "
                          f"lengths ({lp.failed}); each new length is profiled on fake tensors.", UserWarning,
                          stacklevel=6)
        return lp

    def _ahead(self, length: int) -> int:
        """How far to profile for data that has reached ``length``, without seq (see __init__)."""
        ahead = 1 << (2 * length - 1).bit_length()
        if isinstance(self.max_positions, int) and self.max_positions >= length:
            ahead = min(ahead, self.max_positions)
        return ahead

    def _past_seq(self, length):
        if self.seq is not None and length > self.seq:
            warnings.warn(f"gradaccel.checkpoint_blocks(memory=...): a step of length {length} is longer than "
                          f"seq={self.seq}: it is profiled on fake tensors once, and the planned range grows to it",
                          UserWarning, stacklevel=6)

    def _set(self, model, blocks, head, settings, host=False, policies=None):
        # Read by the checkpointed forward (either route: gradaccel/recompute/blocks.py, sliced.py).
        on = host or self.inputs_on_host
        roles = host if isinstance(host, tuple) else ((HOST if on else DEVICE),) * len(blocks)
        set_plans(model, blocks, head, settings, roles, policies)

    def _choose(self, module, args, kwargs, predict=True):
        """``((head, settings), (mode, peak, floor))`` for this call, the inputs on the host
        (``hosts``) where the user asked, or where only then a plan fits."""
        host = self.inputs_on_host
        plan, chosen, fits, policies, roles = self._plan(module, args, kwargs, predict, host)
        if not fits and not host:
            parked = self._plan(module, args, kwargs, predict, True)
            if parked[2] or parked[1][1] < chosen[1]:
                plan, chosen, fits, policies, roles = parked
        if not fits:
            peak = chosen[1]
            warnings.warn(f"gradaccel.checkpoint_blocks: memory={self.memory} bytes is below the least this step can "
                          f"take with gradaccel's plans ({peak} bytes, predicted on fake tensors; short by "
                          f"{peak - self.memory} bytes) at input shape {_key(args, kwargs)}; using that plan. "
                          "Lower the micro-batch or sequence length to fit.", UserWarning, stacklevel=4)
        self.hosts[_key(args, kwargs)] = roles
        self.policies[_key(args, kwargs)] = policies
        return plan, chosen

    def _plan(self, module, args, kwargs, predict, host):
        """``((head, settings), (mode, peak, floor), fits, policies, roles)`` with the inputs on the
        host or not; ``policies``: per block, what its plan keeps, for compiled calls
        (gradaccel/recompute/compiled.py); ``roles``: where the blocks' inputs wait (False: on the
        device; True: every one on the host; else a role per block, gradaccel/memory/parking.py)."""
        profiles = []
        try:
            return self._plan_on(module, args, kwargs, predict, host, profiles)
        finally:
            for prof in profiles:  # profiles are shared (lengths): their terms are the plain ones again
                prof.inputs_on_host = False

    def _plan_on(self, module, args, kwargs, predict, host, profiles):

        def plan(head):
            prof = self._profile(module, args, kwargs, head, predict)
            prof.inputs_on_host = host
            profiles.append(prof)
            # Blocks without a checkpoint park nothing: with the inputs on the host, always checkpointed.
            bare = None if host else uncheckpointed(prof, room)
            if bare is not None:
                return prof, None, bare
            if not host:
                opts = [prof.options(prof.kind_of[i]) for i in range(len(prof.blocks))]
                return prof, opts, least_recompute(prof, opts, room)
            # The layouts the host budget allows (gradaccel/memory/parking.py): the least recompute
            # that fits, or else the one holding least on the device (the last).
            tried = []
            for roles in layouts(prof, self.host_memory) or [False]:  # [False]: not even pairs fit the budget
                prof.inputs_on_host = roles
                opts = [prof.host_options(prof.kind_of[i], False, r) for i, r in enumerate(prof.roles(len(prof.blocks)))]
                tried.append((roles, opts, least_recompute(prof, opts, room)))
            roles, opts, pts = min((t for t in tried if t[2] is not None), default=tried[-1],
                                   key=lambda t: sum(p.cost for p in t[2]))
            prof.inputs_on_host = roles
            return prof, opts, pts

        room = self.memory - (self.gathered or 0)  # ZeRO-3: the parameters gathered at once are the step's too

        tried = {False: plan(False)}
        plain, opts, points = tried[False]
        floor = plain.predict([plain.kind_of[i].zero for i in range(len(plain.blocks))])["peak"] + self.memory - room
        labels = kwargs.get("labels")
        chunkable = self.has_head and torch.is_tensor(labels)
        head_cost = labels.numel() * head_flops(module) if chunkable else 0
        # The loss in chunks costs head_cost more than the model's loss, whatever the blocks run:
        # where the blocks fit with less recompute than that, it cannot be cheaper.
        if chunkable and (points is None or plain.predict(points)["phase"] == "head"
                          and sum(p.cost for p in points) > head_cost):
            tried[True] = plan(True)
        fitting = [(sum(p.cost for p in pts) + head_cost * h, h) for h, (_, _, pts) in tried.items() if pts is not None]
        if fitting:
            head = min(fitting)[1]
            prof, _, points = tried[head]
        else:
            least = {h: least_peak(prof, opts) for h, (prof, opts, _) in tried.items()}
            head = min(least, key=lambda h: tried[h][0].predict(least[h])["peak"])
            prof, points = tried[head][0], least[head]
        peak = prof.predict(points)["peak"] + self.memory - room
        # The split works on estimated block peaks; the least-peak plan's exact peak may fit where
        # its estimate did not: it is then the plan, without a warning.
        if not fitting and peak > self.memory and any(hasattr(t[0], "_source") for t in tried.values()):
            # A predicted profile offers fewer plans than a profile of this length (the candidates
            # fitted across lengths). The plan of the next profiled length holds here too (the
            # same ops on tensors no larger): where it fits there, it is the plan, with no run.
            # Else, before going over the target, profile this length itself, every candidate.
            above = self._plan_above(module, args, kwargs, host, profiles)
            if above is not None:
                return above
            return self._plan_on(module, args, kwargs, False, host, profiles)
        settings = [_setting(p, prof.kind_of[i]) for i, p in enumerate(points)]
        if host:  # a block that keeps everything is still checkpointed: that is what parks its input
            settings = [p.budget if st is None else st for st, p in zip(settings, points)]
        modes = [BlockPlan.parse(s) for s in settings]
        used = {p.slices for p in modes if p.as_parts}
        mode = tuple(m for m, on in (("parts", bool(used)), ("tiles", max(used, default=1) > 1),
                                     ("nested", any(p.mode is Mode.NESTED for p in modes)),
                                     ("sliced", any(p.mode is Mode.SLICED for p in modes)), ("head", head),
                                     ("host", host)) if on)
        policies = [compiled.policy_of(p.plan) if isinstance(st, int) and getattr(p, "plan", None) is not None else None
                    for st, p in zip(settings, points)]
        return ((head, settings), (mode or "blocks", peak, floor), bool(fitting) or peak <= self.memory, policies,
                prof.inputs_on_host)

    def _plan_above(self, module, args, kwargs, host, profiles):
        """:meth:`_plan_on`'s answer at the shortest profiled length above this call's (planned
        there once, with that length's every candidate), where it fits; else None."""
        length, structure = length_of(tree_flatten((args, kwargs))[0])
        lp = self.lengths.get((structure, False))
        above = min((t for t in getattr(lp, "profiles", ()) if t > length), default=None)
        if above is None:
            return None
        key = (structure, above, host)
        if key not in self.above:
            self.above[key] = self._plan_on(module, *at_length((args, kwargs), length, above), True, host, profiles)
        answer = self.above[key]  # ((head, settings), (mode, peak, floor), fits, policies, roles)
        return answer if answer[2] else None


def _key(args, kwargs) -> tuple:
    """A call's input signature: its tensors' shapes and dtypes."""
    return tuple((tuple(t.shape), t.dtype) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))


class _Unprofiled:
    """A structure whose profile at other lengths could not be made: every length is its own."""

    def __init__(self, reason):
        self.failed = reason


def _setting(point, kind):
    """What :meth:`MemoryTarget._set` sets a block to for ``point``."""
    if slices_of(point.plan) > 0:
        return point.plan
    if point.plan == KEEP_ALL or point.cost == 0 and point is kind.frontier[-1]:
        return None  # recomputes nothing: no checkpoint, and none of its cost
    return point.budget
