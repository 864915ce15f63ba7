"""A block's parts: its direct children (attention, MLP, norms) run as keep-nothing checkpoints
of their own; in "tiles" mode a token-wise child (an MLP) runs a slice of the sequence at a
time, each slice its own checkpoint.

A block's plan is a :class:`~gradaccel.recompute.block_plan.BlockPlan`; its settings
(``"parts"``, ``"tiles:n"`` and ``"nested:n"``, this module's, ``"sliced:n"``: the whole block
``n`` slices of the sequence at a time, keys and values whole, gradaccel/memory/sliced.py) are
read by ``BlockPlan.parse`` alone; :func:`slices_of` and the ``is_*`` tests here ask it.

Below the per-block floor, backward's working set is what counts: a block run as parts rebuilds
one part at a time, not the whole block while every gradient made so far is alive; with tiles,
the MLP's rebuild is O(slice x width), not O(tokens x width). The number of slices is the
planner's choice (:func:`slice_counts` offers a few). The ``memory=`` target
(gradaccel/memory/target.py) and the fit choose these as per-block plans.

**Norms join their consumer.** A norm whose output only feeds the next part (Llama's
``input_layernorm`` into ``self_attn``, ``post_attention_layernorm`` into ``mlp``) runs inside
that part's checkpoint (and slices, for a token-wise part) instead of as its own: the block then
holds the residual stream's inputs of its parts (2 for a Llama block) after forward, not each
part's input as well (4), and the MLP's norm is rebuilt a slice at a time with it. Whether a norm
may join is checked once per block structure (:func:`check_structure`, on fake tensors, from the
profile): its output must go, as one argument, to the very next part, and to nothing else (no
other op, not the block's output). Where that does not hold, the norm stays a part of its own,
and :func:`structure_notes` says why.

**Parts inside a keep-nothing checkpoint** (``"nested:n"``). Parts and tiles hold their parts'
inputs (2 hidden states for a Llama block) from forward to backward, and those inputs stay on
the device. A nested plan checkpoints the block whole, as keep-nothing does (it holds its input
alone, which ``inputs_on_host`` can park on the host), and runs its parts inside that
checkpoint: backward's recompute of the block then holds only its parts' inputs, and rebuilds
one part (one slice) at a time. It pays one more forward of the block than keep-nothing (the
parts are rebuilt again inside the recompute), and its backward peak is the parts' at long
context, not the whole block's.
"""

import functools

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from gradaccel.memory.sliced import why_not
from gradaccel.recompute import compiled
from gradaccel.recompute.block_plan import BlockPlan, Mode
from gradaccel.recompute.blocks import model_class
from gradaccel.recompute.own_forward import own_forward

__all__ = ["has_parts", "has_tiles", "install_parts", "set_parts", "slice_counts", "slices_of", "tiles",
           "nested", "is_nested", "sliced", "sliced_count", "is_sliced", "is_parts", "check_structure",
           "structure_notes"]

TILE_CHUNKS = 4  # slices offered where the sequence is too short for MIN_SLICE-token slices
MIN_SLICE = 1024  # tokens: shorter slices make small matmuls and save little more
SLICE_OPTIONS = 4  # slice counts offered at most (each is a block run in the profile)
SLICED_MAX = 256  # a sliced plan's most slices: past it the peak drops little, and the profile's run takes long
PARTS = "parts"


def tiles(n: int) -> str:
    """The plan name of parts with token-wise parts in ``n`` slices: ``"tiles:n"``."""
    return BlockPlan(Mode.TILES, slices=int(n)).to_setting()


def nested(n: int) -> str:
    """The plan name of a keep-nothing checkpoint of the block whose recompute runs its parts,
    token-wise parts in ``n`` slices: ``"nested:n"``."""
    return BlockPlan(Mode.NESTED, budget=0, slices=int(n)).to_setting()


def sliced(n: int) -> str:
    """The plan name of the whole block in ``n`` slices of the sequence, keys and values whole
    (gradaccel/memory/sliced.py): ``"sliced:n"``."""
    return BlockPlan(Mode.SLICED, slices=int(n)).to_setting()


def _parsed(setting):
    """``setting``'s mode where it is a block's setting, else None (a profile's plan object)."""
    if isinstance(setting, str) or setting is None or isinstance(setting, (int, float, tuple, list)):
        try:
            return BlockPlan.parse(setting)
        except ValueError:
            return None
    return None


def slices_of(setting) -> int:
    """Slices of a plan that runs the block in pieces: 1 for ``"parts"``, ``n`` for ``"tiles:n"``,
    ``"nested:n"`` and ``"sliced:n"``, 0 for any other setting (a checkpoint budget, None, "all").
    Such plans are run in the profile (their peak is measured, not estimated)."""
    plan = _parsed(setting)
    return 0 if plan is None else plan.slices


def is_nested(setting) -> bool:
    """Whether ``setting`` is a keep-nothing checkpoint of the block around its parts (``"nested:n"``)."""
    plan = _parsed(setting)
    return plan is not None and plan.mode is Mode.NESTED


def is_sliced(setting) -> bool:
    """Whether ``setting`` runs the whole block a slice of the sequence at a time (``"sliced:n"``)."""
    plan = _parsed(setting)
    return plan is not None and plan.mode is Mode.SLICED


def is_parts(setting) -> bool:
    """Whether ``setting`` runs a block as its parts, uncheckpointed itself (``"parts"`` or
    ``"tiles:n"``; a nested plan checkpoints the block: :func:`is_nested`; a sliced one is a
    node of its own that holds its input alone: :func:`is_sliced`)."""
    plan = _parsed(setting)
    return plan is not None and plan.mode in (Mode.PARTS, Mode.TILES)


def slice_counts(tokens: int) -> list:
    """Slice counts offered for ``tokens`` tokens: powers of two whose slices are at least
    MIN_SLICE tokens, the SLICE_OPTIONS largest (at 8K tokens 2, 4, 8; at 64K 8 to 64: slices
    of 8K to 1K tokens); TILE_CHUNKS where the sequence is shorter than two such slices."""
    counts = []
    n = 2
    while tokens // n >= MIN_SLICE:
        counts.append(n)
        n *= 2
    if not counts:
        return [TILE_CHUNKS] if tokens >= TILE_CHUNKS else []
    return counts[-SLICE_OPTIONS:]


def sliced_count(tokens: int) -> int:
    """The slice count a sliced plan is offered at for ``tokens`` tokens: the finest of
    :func:`slice_counts`, at most SLICED_MAX (0 where none is)."""
    return min(max(slice_counts(tokens), default=0), SLICED_MAX)


# -- parts: a block's children as their own checkpoints -----------------------------------------
def _put(args, kwargs, where, value):
    """``args``/``kwargs`` with ``value`` at ``where`` (a position or a keyword)."""
    if isinstance(where, int):
        return args[:where] + (value,) + args[where:], kwargs
    return args, {**kwargs, where: value}


def _part_forward(module, *args, **kwargs):
    forward = own_forward(module)
    d = module.__dict__
    tiles_n = d.get("_gradaccel_part", 0)  # 0: off; else on, token-wise in that many slices (set_parts)
    if not (tiles_n and module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    consumer = d.get("_gradaccel_joined")
    if consumer is not None:
        # This norm runs inside its consumer's checkpoint: its input goes on as it is.
        consumer.__dict__["_gradaccel_pending"] = args[0]
        return args[0]
    pre = d.get("_gradaccel_pre")
    if pre is not None:
        norm, where = pre
        x = args[where] if isinstance(where, int) else kwargs[where]
        if d.pop("_gradaccel_pending", None) is not x:
            raise RuntimeError(f"gradaccel parts: {type(module).__name__} did not get its norm's input as checked; "
                               "the block's structure differs from the one profiled")
        args, kwargs = (args[:where] + args[where + 1:], kwargs) if isinstance(where, int) else \
            (args, {k: v for k, v in kwargs.items() if k != where})
        inner, norm_forward = forward, own_forward(norm)

        def forward(x, *a, **k):  # noqa: F811 (the norm, then the part, in one checkpoint)
            a, k = _put(a, k, where, norm_forward(x))
            return inner(*a, **k)

        args = (x,) + args
    if tiles_n > 1 and len(args) == 1 and not kwargs and torch.is_tensor(args[0]) and args[0].dim() >= 2:
        # A token-wise part (an MLP, with its norm if joined): each slice of tokens is its own
        # checkpoint, so backward rebuilds one slice's intermediates at a time. Outputs are
        # the same rows, concatenated; weight gradients sum over the slices.
        return torch.cat([compiled.run(forward, (x,), {}, compiled.RECOMPUTE_ALL)
                          for x in args[0].chunk(tiles_n, dim=-2)], dim=-2)
    return compiled.run(forward, args, kwargs, compiled.RECOMPUTE_ALL)  # torch.utils.checkpoint, also under compile


def _token_wise(module: nn.Module) -> bool:
    """An MLP made of linear layers and parameterless activations: each token's output depends
    on that token alone, so it can run a slice of tokens at a time."""
    return type(module).__name__.endswith("MLP") and all(
        isinstance(m, nn.Linear) or not any(True for _ in m.parameters(recurse=False))
        for m in module.modules())


def _norm(module: nn.Module) -> bool:
    """A norm over the last dimension (LayerNorm, RMSNorm): token-wise, 1-d parameters only."""
    return type(module).__name__.endswith("Norm") and all(p.dim() == 1 for p in module.parameters())


def _parts_of(block: nn.Module) -> list:
    return [c for c in block.children() if any(True for _ in c.parameters())]


def has_parts(block: nn.Module) -> bool:
    """Whether ``block`` can run as its parts (two children or more with parameters); if so,
    readies them (:func:`install_parts`)."""
    if len(_parts_of(block)) < 2:
        return False
    install_parts(block)
    return True


def has_tiles(block: nn.Module) -> bool:
    """Whether ``block`` has parts and a token-wise one among them (tiles mode changes it)."""
    return has_parts(block) and any(_token_wise(c) for c in _parts_of(block))


def install_parts(block: nn.Module) -> None:
    """Lets ``block``'s children run as their own checkpoints (off until :func:`set_parts`)."""
    for child in _parts_of(block):
        if "_gradaccel_part" not in child.__dict__:
            child._gradaccel_part = 0
            child.forward = functools.partial(_part_forward, child)


def set_parts(block: nn.Module, on: bool, slices: int = 1) -> None:
    """``on``: ``block``'s children run as keep-nothing checkpoints, each norm inside its
    consumer's where :func:`check_structure` found that safe; ``slices``: its token-wise
    children (MLPs) that many slices of tokens at a time (``True``: TILE_CHUNKS). Whether the
    block itself is checkpointed around them is its plan's (PARTS/TILES: not; NESTED: it is).
    Each child holds one number (``_gradaccel_part``: 0 off, else its slices), the share of the
    block's plan it reads at its forward."""
    slices = TILE_CHUNKS if slices is True else max(1, int(slices or 1))
    if on:
        install_parts(block)
    named = dict(block.named_children())
    joins = _STRUCTURES.get(_structure_key(block), ([], []))[0] if on else []
    for child in _parts_of(block):
        d = child.__dict__
        if "_gradaccel_part" in d:
            child._gradaccel_part = (slices if _token_wise(child) else 1) if on else 0
            for k in ("_gradaccel_joined", "_gradaccel_pre", "_gradaccel_pending"):
                d.pop(k, None)
    for norm, consumer, where in joins:
        # Plain __dict__ entries: a module in an attribute would be registered as a child.
        named[norm].__dict__["_gradaccel_joined"] = named[consumer]
        named[consumer].__dict__["_gradaccel_pre"] = (named[norm], where)


# -- which norms may join their consumer ---------------------------------------------------------
_STRUCTURES = {}  # _structure_key -> (joins [(norm, consumer, where)], notes [str]): check_structure's


def _structure_key(block: nn.Module) -> tuple:
    cls = model_class(block)
    return cls.__module__, cls.__qualname__, tuple(n for n, _ in block.named_children())


class _Uses(TorchFunctionMode):
    """Records the tensors each torch function outside the watched children takes."""

    def __init__(self):
        super().__init__()
        self.inside, self.used = 0, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside and getattr(func, "__name__", "") not in ("__get__", "size", "dim"):
            self.used.update(id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        return func(*args, **kwargs)


def check_structure(block: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Which of ``block``'s norms may run inside the next part's checkpoint: runs ``block``
    once on ``args``/``kwargs`` (fake tensors, no grad) and watches where each norm's output
    goes. Kept per block structure (class and children), for the model's own blocks to use.

    Returns:
        tuple: (joins, notes): ``(norm, consumer, where)`` per norm that joins (``where``: the
        consumer's argument, a position or a keyword), and a line per norm that does not.
    """
    key = _structure_key(block)
    if key in _STRUCTURES:
        return _STRUCTURES[key]
    parts = {id(c): n for n, c in block.named_children() if c in _parts_of(block)}
    calls, uses = [], _Uses()  # calls: [name, args, kwargs, output]

    def pre(module, a, k):
        uses.inside += 1
        calls.append([parts[id(module)], a, k, None])

    def post(module, a, k, out):
        uses.inside -= 1
        next(c for c in reversed(calls) if c[0] == parts[id(module)])[3] = out

    handles = []
    for name, c in block.named_children():
        if id(c) in parts:
            handles += [c.register_forward_pre_hook(pre, with_kwargs=True),
                        c.register_forward_hook(post, with_kwargs=True)]
    forward = model_class(block).forward
    try:
        with torch.no_grad(), uses:
            out = forward(block, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 (a block the check cannot run: its norms stay parts)
        _STRUCTURES[key] = ([], [f"norms run as their own parts: the check could not run the block ({e!r:.200})"])
        return _STRUCTURES[key]
    finally:
        for h in handles:
            h.remove()
    outputs = {id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    named, joins, notes = dict(block.named_children()), [], []
    names = [c[0] for c in calls]
    for i, (name, a, k, y) in enumerate(calls):
        if not _norm(named[name]):
            continue
        why = None
        if names.count(name) != 1:
            why = "it runs more than once"
        elif len(a) != 1 or k or not torch.is_tensor(y):
            why = "it is not called on one tensor"
        elif i + 1 == len(calls) or names.count(names[i + 1]) != 1:
            why = "no part (called once) follows it"
        elif id(y) in uses.used or id(y) in outputs:
            why = "its output is used outside the next part"
        else:
            _, ca, ck, _ = calls[i + 1]
            at = [j for j, t in enumerate(ca) if t is y] + [n for n, t in ck.items() if t is y]
            refs = sum(1 for t in tree_flatten((ca, ck))[0] if t is y)
            if len(at) != 1 or refs != 1:
                why = f"{names[i + 1]} does not take its output as one argument"
            else:
                joins.append((name, names[i + 1], at[0]))
                continue
        notes.append(f"{name} runs as its own part: {why}")
    _STRUCTURES[key] = (joins, notes)
    return _STRUCTURES[key]


def structure_notes(block: nn.Module) -> list:
    """Lines on how ``block`` runs as parts: which norms join which part, and why others do not
    (empty until :func:`check_structure` has seen its structure)."""
    if not has_parts(block):
        return [f"{type(block).__name__} has fewer than two parts with parameters: it is not run as parts"]
    joins, notes = _STRUCTURES.get(_structure_key(block), ([], ["not checked yet: norms run as their own parts"]))
    lines = [f"{n} runs inside {c}'s checkpoint" + (" and slices" if _token_wise(dict(block.named_children())[c])
                                                    else "") for n, c, _ in joins]
    if not has_tiles(block):
        lines.append("no token-wise part (an MLP of linear layers): nothing is sliced")
    why = why_not(block)
    if why is not None:
        lines.append(f"no sliced plan (the block a slice at a time, K/V whole): {why}")
    return lines + notes
