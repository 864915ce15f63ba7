"""gradaccel/recompute/backports.py: what the symbolic pass needs of torch 2.13 on torch 2.11.

The Python copy of aten's C++ matmul must trace as the C++ code does, op for op (arguments and
tensor geometry included), or a region's symbolic trace would not match its real one. Checked
on every torch against that torch's own kernel, on real tensors: every rank pairing, layouts
that fold and that do not, broadcast batches, batches of one, with and without grad. And fake
tensors take a Parameter subclass that adds only Python (bitsandbytes' Params4bit) as a
Parameter inside the block."""

import itertools

import pytest
import torch
from torch.utils._pytree import tree_map

from gradaccel.recompute import symbolic
from gradaccel.recompute import backports
from gradaccel.recompute.backports import python_matmul
from tests._ops import OpLog


def _op_and_geometry(func, args, kwargs, out):
    """An op with its arguments, a tensor by its geometry and dtype (prims left out)."""
    if func.namespace == "prim":
        return []
    geometry = lambda x: (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype) \
        if isinstance(x, torch.Tensor) else x  # noqa: E731
    return [(func, tree_map(geometry, (args, kwargs)))]


def _run(a, b):
    """(ops, output, gradients) of ``a @ b`` with fresh leaves of ``a`` and ``b``."""
    a, b = (t.detach().requires_grad_(t.requires_grad) for t in (a, b))
    with OpLog(_op_and_geometry) as seen:
        out = a @ b
    wrt = [t for t in (a, b) if t.requires_grad]
    return seen.ops, out, torch.autograd.grad(out.sum(), wrt) if wrt else ()


def _layouts(shape):
    """Contiguous; the last two dims transposed; the first two; every other column."""
    yield torch.randn(*shape)
    if len(shape) >= 2:
        yield torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if len(shape) >= 3:
        yield torch.randn(shape[1], shape[0], *shape[2:]).transpose(0, 1)
        yield torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


LEFT = [(4,), (5, 4), (2, 5, 4), (3, 2, 5, 4), (1, 5, 4)]
RIGHT = [(4,), (4, 6), (2, 4, 6), (3, 2, 4, 6), (1, 4, 6), (4, 1)]


@pytest.mark.parametrize("left,right", list(itertools.product(LEFT, RIGHT)), ids=str)
def test_the_copy_runs_the_ops_of_torchs_own_matmul(left, right):
    torch.manual_seed(0)
    checked = 0
    for a, b in itertools.product(list(_layouts(left)), list(_layouts(right))):
        for grads in itertools.product([False, True], repeat=2):
            a.requires_grad_(grads[0])
            b.requires_grad_(grads[1])
            try:
                ops, out, wrt = _run(a, b)
            except RuntimeError:  # not multipliable (4 @ 4x1 after broadcasting): both raise
                with python_matmul(), pytest.raises(RuntimeError):
                    _run(a, b)
                continue
            with python_matmul():
                ops_copy, out_copy, wrt_copy = _run(a, b)
            assert ops_copy == ops, (a.shape, a.stride(), b.shape, b.stride(), grads)
            for x, y in zip((out, *wrt), (out_copy, *wrt_copy), strict=True):
                assert torch.equal(x, y)  # the same kernels on the same views
            checked += 1
    assert checked or left == (4,) and right == (4, 1)


def test_torchs_own_kernel_is_back_after_the_block(monkeypatch):
    calls = []
    copy = backports._matmul
    monkeypatch.setattr(backports, "_matmul", lambda a, b: calls.append(1) or copy(a, b))
    a, b = torch.randn(2, 5, 4), torch.randn(4, 6)
    with python_matmul():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert (a @ b).dtype == torch.bfloat16  # autocast's kernel still comes first
        assert (a @ b).dtype == torch.float32
    assert len(calls) == 2
    a @ b
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a @ b
    assert len(calls) == 2


def test_the_symbolic_pass_keeps_matmul_sizes_symbolic_on_this_torch():
    """On every supported torch (2.11 on): with torch's own kernel (2.13) or with the copy
    (2.11), batched and folded products keep their sizes symbolic."""
    assert symbolic.sizes_matmul(), torch.__version__


class _Packed(torch.nn.Parameter):
    """A Parameter subclass that adds only Python (bitsandbytes' Params4bit)."""


class _Wrapped(torch.nn.Parameter):
    """A Parameter subclass with a __torch_dispatch__ of its own: fake tensors leave it to that."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_fake_tensors_take_a_parameter_subclass_as_a_parameter_in_the_block():
    from torch._subclasses import fake_tensor

    own = fake_tensor._check_for_subclass_arg
    packed, wrapped = _Packed(torch.randn(4, 6)), _Wrapped(torch.randn(4, 6))
    with backports.parameter_subclasses(), fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        out = packed.view(-1, 1)
        assert isinstance(out, fake_tensor.FakeTensor) and out.shape == (24, 1)
        assert fake_tensor._check_for_subclass_arg(wrapped)  # still left to its own __torch_dispatch__
    assert fake_tensor._check_for_subclass_arg is own
