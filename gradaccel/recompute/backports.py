"""What the symbolic pass (gradaccel/recompute/symbolic.py) needs of torch 2.13, on older torch
(2.11, the oldest supported). Each is on only while a pass runs, and only where this torch lacks
it: each is probed, not read from the version.

**matmul on symbolic sizes** (:func:`python_matmul`). ``matmul`` has no kernel of its own: its
C++ code (a composite, which ``linear`` without bias calls too) picks ``mm``, ``mv`` or ``bmm``
and the views around them. Before torch 2.13 that code reads its operands' sizes as plain
ints: the folded path (3-d @ 2-d, so every ``Linear`` without bias on 3-d input) fails on
symbolic sizes ("Cannot call numel() on tensor with symbolic sizes/strides"), and the batched
path (attention's ``q @ k^T``) turns each size into the traced number. So there, while a pass
runs, ``aten::matmul``'s composite kernel is :func:`_matmul`: the C++ code's decisions and
aten ops, in the same order with the same arguments (tests/recompute/test_backports.py
compares the two on real tensors, op by op), with sizes read as symbols. Which path it takes
is then a guard of the pass, as any branch of the region's own Python. torch's own Python
decomposition (``torch._decomp``) does not serve: it records other ops than the C++ code in
most cases (``view`` for ``_unsafe_view``, ``squeeze`` for ``squeeze_``, no transpose where
``should_fold`` makes one), and a trace that differs from the real one gives no formulas. The
kernel is registered process-wide (the dispatcher has no per-thread kernels): another thread's
matmul meanwhile runs it too, with the same results.

**Parameter subclasses** (:func:`parameter_subclasses`). bitsandbytes' ``Params4bit``, the
4-bit weight of every QLoRA layer, is a ``Parameter`` subclass that adds only Python. torch
2.11's fake tensors refuse any op that reads one (``FakeTensorMode`` returns NotImplemented:
"Multiple dispatch failed for 'aten.view.default'"), so a QLoRA layer's pass fails; torch
2.13's treat a subclass without a ``__torch_dispatch__`` of its own as the ``Parameter`` it is.
While a pass runs, so do torch 2.11's.
"""

import contextlib
import functools
import math
import warnings

import torch
from torch._subclasses import fake_tensor as _fake_tensor
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def python_matmul():
    """``aten::matmul`` runs :func:`_matmul` inside the block (its C++ kernel again after)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # torch's note, once a process, that a kernel was overridden
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            lib.impl("matmul", _matmul, "CompositeImplicitAutograd")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def parameter_subclasses():
    """Fake tensors take a ``Parameter`` subclass without a ``__torch_dispatch__`` of its own as
    a ``Parameter`` inside the block, as torch 2.13's do: a private function of torch's,
    ``fake_tensor._check_for_subclass_arg``, is swapped for :func:`_subclass_rule` meanwhile."""
    if _TORCH_RULE is None or not _refuses_parameter_subclasses():  # torch 2.13 on
        yield
        return
    _fake_tensor._check_for_subclass_arg = _subclass_rule
    try:
        yield
    finally:
        _fake_tensor._check_for_subclass_arg = _TORCH_RULE  # torch's own, whatever ran meanwhile


_TORCH_RULE = getattr(_fake_tensor, "_check_for_subclass_arg", None)


def _subclass_rule(x) -> bool:
    """torch 2.13's ``_check_for_subclass_arg``: whether fake tensors leave ``x`` to its subclass."""
    return _TORCH_RULE(x) and not (isinstance(x, torch.nn.Parameter)
                                   and type(x).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


@functools.cache
def _refuses_parameter_subclasses() -> bool:
    with _disable_current_modes():  # a real probe, also when first asked inside a fake mode
        return _TORCH_RULE(_Params(torch.empty(0)))


class _Params(torch.nn.Parameter):
    """A ``Parameter`` subclass that adds only Python, as bitsandbytes' ``Params4bit``."""


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """aten/src/ATen/native/LinearAlgebra.cpp's ``_matmul_impl`` (without ``out=``)."""
    da, db = a.dim(), b.dim()
    torch._check(da != 0 and db != 0,
                 lambda: f"both arguments to matmul need to be at least 1D, but they are {da}D and {db}D")
    if da == 1 and db == 1:
        return a.dot(b)
    if da == 2 and db == 1:
        return a.mv(b)
    if da == 1 and db == 2:
        return a.unsqueeze(0).mm(b).squeeze_(0)
    if da == 2 and db == 2:
        return a.mm(b)
    if _should_fold(a, b):  # the larger operand's batch folded into its rows: one mm (or mv)
        transpose = db > da
        t1 = b.mT if transpose else a
        t2 = (a.t() if da == 2 else a) if transpose else b
        shape = list(t1.shape[:-1])
        folded = t1.reshape(math.prod(shape), t1.shape[-1])
        if t2.dim() == 2:
            out = torch.ops.aten._unsafe_view(folded.mm(t2), shape + [t2.shape[1]])
            return out.mT.contiguous() if transpose else out
        return torch.ops.aten._unsafe_view(folded.mv(t2), shape)
    # Batched: broadcast the batch dimensions, flatten them, one bmm.
    n, m1 = a.shape[-2] if da > 1 else 1, a.shape[-1]
    m2, p = (b.shape[-2], b.shape[-1]) if db > 1 else (b.shape[0], 1)
    batch1, batch2 = list(a.shape[:max(da - 2, 0)]), list(b.shape[:max(db - 2, 0)])
    if da == 3 and db == 3 and batch1[0] != batch2[0]:  # a batch of one: a 2-d operand
        if batch1[0] == 1 and (a.requires_grad or _subclass_like(a)):
            return _matmul(a.squeeze(0), b)
        if batch2[0] == 1 and (b.requires_grad or _subclass_like(b)):
            return _matmul(a, b.squeeze(0))
    batch = list(torch.broadcast_shapes(batch1, batch2))
    product = math.prod(batch)
    a3 = a.expand(batch + [n, m1]).reshape(product, n, m1)
    if db == 1:
        b3 = b.expand(batch + [m2]).reshape(product, m2).unsqueeze(2)
    else:
        b3 = b.expand(batch + [m2, p]).reshape(product, m2, p)
    out = a3.bmm(b3)
    shape = batch + ([n] if da > 1 else []) + ([p] if db > 1 else [])
    return torch.ops.aten._unsafe_view(out.squeeze(-1) if db == 1 else out, shape)


def _should_fold(a: torch.Tensor, b: torch.Tensor) -> bool:
    """LinearAlgebra.cpp's ``should_fold``: whether the larger operand (3-d or more, against
    one of 1 or 2) folds into a matrix without a copy, or must (the smaller one requires grad)."""
    larger = a.dim() >= b.dim()
    t1 = a if larger else b.mT  # computed as the C++ code does: its transpose is recorded
    small = b if larger else a
    if not (t1.dim() >= 3 and small.dim() <= 2):
        return False
    if small.requires_grad:
        return True
    if a.dim() == 2:
        return False
    if t1.numel() == 0:
        return True
    shape, stride = t1.shape, t1.stride()
    return all(stride[i] == stride[i + 1] * shape[i + 1] for i in range(t1.dim() - 2))


def _subclass_like(t: torch.Tensor) -> bool:
    """ATen's ``isTensorSubclassLike`` as far as it matters here: a Python tensor (a fake one)
    or a dispatch mode on (gradaccel's recorder, in the real trace and the symbolic pass)."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)
