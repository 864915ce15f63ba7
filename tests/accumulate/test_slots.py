"""GradSlots (gradaccel/accumulate/slots.py): each parameter's slice of the flat buffer is laid out like
the parameter, as autograd lays out .grad, so that optimizers, fused ones most of all, pair
gradient and parameter element by element; and masters and their state are fp32."""

import pytest
import torch

from gradaccel import FusedAccumOptimizer


class _Strided(torch.nn.Module):
    """Parameters not laid out row-major: a channels_last conv weight and a transposed matrix."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.w = torch.nn.Parameter(torch.randn(5, 4).t())

    def forward(self, x):
        return (self.conv(x).mean((2, 3)) @ self.w).square().mean()


FUSED = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_optimizers_on_strided_parameters_bit_exact(name):
    # Fused kernels pair .grad with the parameter element by element in memory: each slice of the
    # buffer must be laid out like its parameter, as autograd lays out .grad.
    model, ref = _Strided(), _Strided()
    assert not model.conv.weight.is_contiguous() and not model.w.is_contiguous()
    opt = FusedAccumOptimizer(FUSED[name](model.parameters()), 3)
    ref_opt = FUSED[name](ref.parameters())
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        xs = [torch.randn(2, 3, 6, 6, generator=g) for _ in range(3)]
        for k, x in enumerate(xs):
            if k == 1:  # grads set by hand, row-major, take the other fold path (not the hook)
                hand = [torch.randn(p.shape, generator=g) for p in model.parameters()]
                for p, h in zip(model.parameters(), hand):
                    p.grad = h.clone()
            else:
                model(x).backward()
            opt.step()
            opt.zero_grad()
            if k == 1:
                for q, h in zip(ref.parameters(), hand):
                    q.grad += h
            else:
                ref(x).backward()
        for p in ref.parameters():
            p.grad.mul_(torch.tensor(1 / 3, dtype=torch.float32))
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.stride() == q.stride() and torch.equal(p, q), name


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")
def test_adagrad_master_state_is_fp32_and_backward_with_create_graph_folds():
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = FusedAccumOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), 2, master_weights=True)
    assert {v.dtype for s in opt.state.values() for v in s.values() if v.is_floating_point()} == {torch.float32}
    x = torch.randn(5, 4).bfloat16()
    model(x).float().square().sum().backward(create_graph=True)  # stock allows it; the fold keeps values
    assert all(p.grad is None for p in model.parameters())
    model(x).float().square().sum().backward()
    assert opt.step() is False and opt.step() is True


def test_layout_changed_after_wrapping_and_state_dict_across_layouts():
    def conv(channels_last):
        torch.manual_seed(0)
        m = torch.nn.Conv2d(3, 4, 3)
        return m.to(memory_format=torch.channels_last) if channels_last else m

    xs = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def run(m, opt, batch):
        for x in batch:
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    # Re-laid out after the optimizer was built: the update still pairs grad and parameter.
    model, ref = conv(False), conv(True)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, fused=True), 1)
    model.to(memory_format=torch.channels_last)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
    run(model, opt, xs[:2])
    run(ref, ref_opt, xs[:2])
    assert torch.equal(model.weight, ref.weight)
    # A window saved from a channels_last model resumes in a row-major one, and back.
    for src_layout in (True, False):
        a = conv(src_layout)
        opt_a = FusedAccumOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, foreach=True), 2)
        run(a, opt_a, xs[:1])
        state = opt_a.state_dict()
        b = conv(not src_layout)
        opt_b = FusedAccumOptimizer(torch.optim.SGD(b.parameters(), lr=0.1, foreach=True), 2)
        opt_b.load_state_dict(state)
        # The window itself crosses layouts unchanged: no arithmetic, so bit for bit.
        assert torch.equal(opt_b.state_dict()["gradaccel"]["flat"], state["gradaccel"]["flat"])
        run(a, opt_a, xs[1:])
        run(b, opt_b, xs[1:])
        # From here each model runs its own layout's conv kernels, which need not round alike
        # (on some CPUs they don't): a tolerance of a few ulps of the update. A slice laid out in
        # the wrong order would scramble elements, an error of the size of the update itself.
        torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a.weight, conv(src_layout).weight, rtol=1e-3, atol=1e-4)  # it moved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, channels_last, head", [
    ((1,), False, 7), ((17,), False, 7), ((4099,), False, 7), ((2 ** 16 + 3,), False, 1000),
    ((2 ** 16 + 3,), False, None), ((3, 5, 7, 9), True, 7)])
def test_narrow_in_place_rounds_like_to_and_leaves_the_neighbours(dtype, shape, channels_last, head, monkeypatch):
    # The rounding a bf16/fp16 parameter without a master gets at the update, written into its own
    # slice: the same values as view.to(dtype) (the same cast), laid out like the view, and the
    # slices on either side untouched, however many in-place copies the slice takes.
    from gradaccel.accumulate import flat as _flat
    if head is not None:
        monkeypatch.setattr(_flat, "NARROW_HEAD", head)
    p = torch.empty(shape)
    if channels_last:
        p = p.to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(len(shape))
    flat = torch.randn(5 + p.numel() + 6, generator=g) * 1e3
    flat[7] = 1e6  # past fp16's range: rounds to inf, as .to does
    view = _flat.slice_like(flat, 5, p)
    assert view.stride() == p.stride()
    expected, before = view.to(dtype), flat.clone()
    out = _flat.narrow_in_place(flat, 5, view, dtype)
    assert out.dtype == dtype and out.stride() == p.stride() and torch.equal(out, expected)
    assert out.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(flat[:5], before[:5]) and torch.equal(flat[5 + p.numel():], before[5 + p.numel():])
