"""The structure cache: plans that hold across sizes, one trace per *structure* of a region.

A region's trace (gradaccel/recompute/trace.py) is taken at one input signature. Sequence lengths change
almost every step in real fine-tuning, so plans are cached per *structure*: the signature with
the sizes and strides of its tensors left out (what stays: rank, which sizes and strides are 0
or 1, storage offsets, dtypes, devices, aliasing, every non-tensor argument but plain ints,
module state). A plain int argument of 2 or more (``max_length_q``, a length passed as a
number) is a size too: it is left out of the structure, and is a symbol of its own in the
symbolic pass, so formulas and guards may read it (0 and 1 stay in the key, as sizes do).

Within a structure, the first traced call is the *template*. When a call of another size comes,
the region's Python runs once more, on fake tensors whose sizes and strides are symbols (torch's
``ShapeEnv``, one symbol per input size or stride, never merged by value), under the same
recorder. That gives every number of the trace (op arguments such as view shapes and arange
lengths, tensor geometry, storage bytes, FLOPs) as a formula of the input sizes, and the
*guards*: the conditions on the sizes under which the region takes the same path (a branch on
the length, a slice inside a buffer, a kernel choice that reads sizes). The symbolic trace must
match the template op for op, and its formulas must give back the template's numbers at the
template's sizes, or it is not used (the symbolic pass: gradaccel/recompute/symbolic.py; the
formulas: gradaccel/recompute/formulas.py).

Every later call of the structure at a new size is then: evaluate the formulas and guards (one
compiled Python function), build the trace at those sizes, and plan it (the C++ planner). No
trace, no recompute beyond that size's plan. Where a guard fails (the structure changes with the
size), the call is traced anew and becomes another template. The frame checks every saved tensor
of a sized plan against the formulas' shape, stride and offset (gradaccel/recompute/frames.py), so a call
that strays from the prediction keeps what it saves and is traced again next time.

This module holds the cache: a callable's structures (:func:`structures_of`), each with its
templates (:class:`Structure`), and the formulas that the modules of one kind share
(:func:`module_kind`: what a module's code runs on; :func:`is_plain`: the values a trace freezes
in as constants).
"""

import collections
import copy
import dataclasses
import numbers

import torch
from torch._subclasses.fake_tensor import FakeTensor

from gradaccel.recompute.formulas import geometry_of, is_size_int
from gradaccel.recompute.symbolic import analyse
from gradaccel.recompute.trace import Graph

MAX_TEMPLATES = 4  # traces kept per structure (a structure that changes with the size has several)
MAX_STRUCTURES = 16  # structures kept per callable; the least recently used goes first
MAX_RETRACE = 64  # signatures of a structure waiting to be traced again


def without_sizes(part):
    """One part of a plan's key (gradaccel/recompute/checkpoint.py ``_signature``) as a structure keeps it:
    of a tensor's geometry, its rank, which sizes and strides are 0 or 1 (torch's symbolic shapes
    specialise those) and its storage offset. Other parts stay as they are."""
    if type(part) is tuple and len(part) == 5 and type(part[0]) is tuple and len(part[0]) == 3 \
            and type(part[0][0]) is torch.Size:
        shape, stride, offset = part[0]
        return ((len(shape), tuple(d if d < 2 else -1 for d in shape), tuple(s if s < 2 else -1 for s in stride),
                 offset),) + part[1:]
    if type(part) is tuple and len(part) == 2 and part[0] is int and is_size_int(part[1]):
        return (int, "size")  # not -1: an argument of -1 stays a structure of its own
    return part



@dataclasses.dataclass
class Template:
    """A traced graph of a structure, the sizes it was traced at, and (once a call of another
    size asked) its formulas: a :class:`Formulas`, or False where they could not be had."""

    graph: Graph
    geometry: dict  # flat index -> (shape, stride) of each tensor argument, or value of each size int, when traced
    formulas: object = None
    why: str = ""  # where formulas is False: why they could not be had (for warnings and plan_rows)


class Structure:
    """The templates of one structure (most recently used first) and its counters."""

    def __init__(self):
        self.templates: list[Template] = []
        self.traces = 0  # calls traced for this structure
        self.sized = 0  # calls planned from formulas, with no trace
        self.planned = 0  # calls that ran a plan made at an earlier call of the same signature
        self.retrace: set = set()  # exact signatures to trace on their next call (a sized call strayed)
        self.kind = None  # what callables of the same code and settings share (see module_kind)
        self.passes = 0  # symbolic passes run for it (each costs about a forward's Python, on fake tensors)
        self.why = ""  # why its last symbolic pass gave no formulas (new sizes are then traced)

    def add(self, graph: Graph, flat: list) -> None:
        self.traces += 1
        geometry = geometry_of(flat)
        self.templates.insert(0, Template(graph, geometry))
        del self.templates[MAX_TEMPLATES:]

    def strayed(self, key) -> None:
        """A call sized from formulas saved other tensors than predicted: its exact signature is
        traced on its next call (a bounded set: one forgotten is merely sized, and strays, again)."""
        if len(self.retrace) >= MAX_RETRACE:
            self.retrace.pop()
        self.retrace.add(key)

    def sized_graph(self, fn, flat: list, spec) -> Graph | None:
        """The trace at the sizes of ``flat``, from a template's formulas; None where no
        template holds at these sizes (the call is to be traced)."""
        for k, template in enumerate(self.templates):
            if template.formulas is None:
                self._find_formulas(template, fn, flat, spec)
            if template.formulas:
                graph = template.formulas.graph_at(flat)
                if graph is not None:
                    self.templates.insert(0, self.templates.pop(k))
                    self.sized += 1
                    return graph
        return None


    def prepare(self, fn, flat: list, spec) -> None:
        """Finds the newest template's formulas now, at the call that traced it, rather than at
        the first call of another size: for a region whose caller said its lengths will vary
        (``checkpoint_blocks(..., seq=...)``), so that the symbolic pass is paid at the start of
        training, not at some step in the middle of it."""
        template = self.templates[0]
        if template.formulas is None and not any(isinstance(x, FakeTensor) for x in flat):
            self._find_formulas(template, fn, flat, spec)

    def _find_formulas(self, template: Template, fn, flat: list, spec) -> None:
        """Sets ``template.formulas``: another callable of the kind's that match it, else a
        symbolic pass at the sizes of ``flat`` (False where none can be had)."""
        template.formulas = _shared(self.kind, template)
        if template.formulas is None and self.passes < MAX_TEMPLATES:  # not one pass per length
            self.passes += 1
            template.formulas = analyse(template, fn, flat, spec)
        template.formulas = template.formulas or False
        if template.formulas:
            self.why = ""
            if self.kind is not None:
                _share(self.kind, template.formulas)
        elif template.why:
            self.why = template.why


def structures_of(shapes: dict, key) -> Structure:
    """The Structure for ``key`` in one callable's ``shapes`` (an LRU dict), made if new."""
    structure = shapes.pop(key, None) or Structure()
    shapes[key] = structure
    while len(shapes) > MAX_STRUCTURES:
        shapes.pop(next(iter(shapes)))
    return structure



_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size})
_NOT_PLAIN = frozenset({dict, collections.OrderedDict, set, list})  # a module's own fields


def is_plain(v) -> bool:
    """A value a trace freezes in as a constant, so plans are keyed by its value: a number
    (Python's or numpy's), a string, bytes, ``None``, a dtype, a device, a ``torch.Size``, or a
    tuple of those (``normalized_shape``). Anything else (a module, a config object) is keyed by
    identity, so that the cache never keeps it alive. By exact type first: this runs on every call.

    Args:
        v: any value (a module attribute, a region's argument).

    Returns:
        bool: whether ``v`` is plain.
    """
    t = type(v)
    if t in _PLAIN:
        return True
    if t in _NOT_PLAIN:
        return False
    if t is tuple:
        return all(type(e) in _PLAIN for e in v)
    return isinstance(v, (numbers.Number, str, bytes, torch.dtype, torch.device))


_ABSENT = object()


def module_kind(module: torch.nn.Module) -> tuple:
    """What a module's code runs on, as a hashable key: modules of one kind run the same code on
    the same settings, so they trace alike. The layers of a model are one kind: one symbolic pass
    serves all of them, a new length is sized once for all (each layer's own trace must still
    match the formulas op for op), and the memory planner traces one block per kind
    (gradaccel/memory/profile.py).

    Per submodule: its name and class; its plain attributes (:func:`is_plain`) except layer
    indices (names ending in ``idx`` or ``index``), gradaccel's own settings (``_gradaccel_*``:
    the plan memory= or fit gives each block is an input of the plan, not of the trace) and
    values equal to their class's default (``gradient_checkpointing = False`` once set on the
    instance reads the same as the class's); its parameters' shapes, dtypes and trainability;
    its buffers' shapes and dtypes.

    Args:
        module: the module (a transformer block, say).

    Returns:
        tuple: equal for two modules of one kind.
    """
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in sub.__dict__.items()
                             if is_plain(v) and not k.endswith(("idx", "index")) and not k.startswith("_gradaccel_")
                             and not _class_default(type(sub), k, v)))
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in sub._parameters.items() if p is not None)
        buffers = tuple((k, tuple(b.shape), b.dtype) for k, b in sub._buffers.items() if b is not None)
        parts.append((name, type(sub), attrs, params, buffers))
    return tuple(parts)


def _class_default(cls: type, name: str, v) -> bool:
    """Whether ``v`` equals ``cls``'s own value of attribute ``name`` (a plain one: a property or
    a tensor is never a default)."""
    default = getattr(cls, name, _ABSENT)
    return default is not _ABSENT and is_plain(default) and type(default) is type(v) and default == v


MAX_KINDS = 64  # kinds whose formulas are kept for other callables of the kind


def _shared(kind, template: Template):
    """Formulas another callable of ``kind`` found, rebound to ``template`` if they match it."""
    from gradaccel.recompute.state import STATE

    for formulas in STATE.kinds.get(kind, ()) if kind is not None else ():
        if formulas.matches(template.graph, template.geometry):
            mine = copy.copy(formulas)
            mine.template = template.graph
            return mine
    return None


def _share(kind, formulas) -> None:
    from gradaccel.recompute.state import STATE

    found = STATE.kinds.pop(kind, [])
    STATE.kinds[kind] = [formulas] + [f for f in found if f.sym is not formulas.sym][:MAX_TEMPLATES - 1]
    while len(STATE.kinds) > MAX_KINDS:
        STATE.kinds.pop(next(iter(STATE.kinds)))
