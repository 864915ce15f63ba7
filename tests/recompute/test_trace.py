"""gradaccel/recompute/trace.py on its own: what it needs of the torch build it runs on."""

import subprocess
import sys

_HIDE_AND_IMPORT = """
import torch
import torch._dynamo  # torch's own modules that use the op are imported before it goes
aten = torch.ops.aten
aten.__dict__.pop("_batch_norm_with_update", None)  # an op resolved earlier is cached there
real = type(aten).__getattr__
def hide(self, name):
    if self is aten and name == "_batch_norm_with_update":
        raise AttributeError(name)
    return real(self, name)
type(aten).__getattr__ = hide
assert not hasattr(aten, "_batch_norm_with_update")
import gradaccel
from gradaccel.recompute import trace as _trace
assert _trace._STATEFUL and "_batch_norm_with_update" not in {p.__name__ for p in _trace._STATEFUL}
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
x = torch.randn(5, 4, requires_grad=True)
for _ in range(2):
    gradaccel.checkpoint(net, x, budget=0.5).sum().backward()
print("ok")
"""


def test_a_private_aten_op_missing_from_this_torch_does_not_break_import():
    # Private ops (_batch_norm_with_update and friends) come and go between torch releases.
    done = subprocess.run([sys.executable, "-c", _HIDE_AND_IMPORT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# -- the graph of hand-written op sequences ----------------------------------------------------
import torch  # noqa: E402

from gradaccel.recompute.plan import rebuildable  # noqa: E402
from gradaccel.recompute.roles import Leaf, Source  # noqa: E402
from gradaccel.recompute.trace import Graph, Recorder  # noqa: E402


def trace(fn, *args, preserve_rng_state=True):
    """``fn(*args)`` recorded, with every tensor autograd saves noted as the traced call does."""
    graph = Graph(list(args), preserve_rng_state)
    recorder = Recorder(graph)

    def pack(t):
        recorder.paused = True
        graph.add_pack(t)
        recorder.paused = False
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        out = fn(*args)
    graph.finish(out)
    return graph, out


def names(graph):
    return [str(op.func) for op in graph.ops]


def test_ops_storages_and_bytes_with_a_view_counted_once():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    seen = {}

    def f(x, w):
        a = (x @ w).relu()  # mm saves x and w; relu saves its output
        v = a.view(64)
        seen["a"] = a
        return (v * v).sum()  # mul saves v twice: a view of a's storage

    graph, _ = trace(f, x, w)
    assert names(graph) == ["aten.mm.default", "aten.relu.default", "aten.view.default", "aten.mul.Tensor",
                            "aten.sum.default"]
    mm, relu, view, mul, total = graph.ops
    assert mm.flops == 2 * 4 * 8 * 16
    # New storages: mm's, relu's, mul's and sum's; the view makes none.
    assert [len(op.new_storages) for op in graph.ops] == [1, 1, 0, 1, 1]
    a_sid = relu.new_storages[0][0]
    assert graph.storages[a_sid].nbytes == 4 * 16 * 4 and graph.storages[a_sid].creator == 1
    assert view.reads == [graph.storages[a_sid].versions[0]] and mul.reads == 2 * view.reads
    # The arguments existed before the region; the generator's pseudo-storage is storage 0.
    externals = {s.external for s in graph.storages if s.creator < 0 and s.external is not None}
    assert externals == {Leaf(Source.ARG, 0), Leaf(Source.ARG, 1)}
    # Saved: x, w, a, and a's view twice. Activations: a's storage once (views cost nothing);
    # mm's output is not saved, and the sum is returned.
    assert len(graph.packs) == 5 and graph.activations == [a_sid]
    assert graph.activation_bytes == seen["a"].untyped_storage().nbytes() == 256


def test_in_place_ops_make_versions_of_one_storage():
    x = torch.randn(4, 8, requires_grad=True)
    buf = torch.zeros(4, 8)

    def f(x, buf):
        a = x.exp()
        a.mul_(2)  # a new version of a's storage, which replay can rebuild
        b = buf.exp()  # reads buf as it was before the write below
        buf.add_(1)  # a write to a storage from before the region: never replayed
        return a.sin() + b + buf.exp()

    graph, _ = trace(f, x, buf)
    assert names(graph) == ["aten.exp.default", "aten.mul_.Tensor", "aten.exp.default", "aten.add_.Tensor",
                            "aten.sin.default", "aten.add.Tensor", "aten.exp.default", "aten.add.Tensor"]
    exp, mul_, exp_before, add_, sin, _, exp_after, _ = graph.ops
    a_sid = exp.new_storages[0][0]
    first, second = graph.storages[a_sid].versions
    assert graph.values[second] == (a_sid, 1) and mul_.new_storages == [] and sin.reads == [second]
    assert not graph.is_leaf_value(first) and graph.is_leaf_value(second)
    assert mul_.replayable and not add_.replayable
    # The planner's answer to "can replay rebuild it from what existed before the region": replay
    # reads buf as the forward leaves it, so what read buf before the write cannot be rebuilt.
    assert rebuildable(graph, a_sid) and rebuildable(graph, exp_after.new_storages[0][0])
    assert not rebuildable(graph, exp_before.new_storages[0][0])


def test_random_ops_read_and_write_the_generator():
    x = torch.randn(16, requires_grad=True)
    for preserve in (True, False):
        graph, _ = trace(lambda x: torch.nn.functional.dropout(x, 0.5).exp(), x, preserve_rng_state=preserve)
        random = [op for op in graph.ops if op.random]
        rng_versions = graph.storages[Graph.RNG].versions  # the state at entry, then one per random op
        assert random and len(rng_versions) == 1 + len(random)
        assert [op.reads[-1] for op in random] == rng_versions[:-1]
        assert all(op.replayable == preserve for op in random)  # without the state, results are kept


def test_a_tensor_from_outside_the_arguments_and_a_conjugate_view():
    w = torch.randn(8, requires_grad=True)
    graph, _ = trace(lambda x: (x * w).sum(), torch.randn(8))
    (obj,) = [s.external for s in graph.storages if s.external is not None and s.external.source is Source.OBJ]
    assert obj.at() is w and not graph.dynamic
    z = torch.randn(4, dtype=torch.complex64)
    graph, _ = trace(lambda z: z.conj() * 2, z)
    assert graph.dynamic and "conjugate" in graph.dynamic_reason  # replay sees storages, not the flag
