"""gradaccel/recompute/frames.py on its own: what each frame's pack hook does with a saved tensor, and that
its unpack hook hands back the very values the forward saved (bit for bit: replay runs the same
kernels on the same inputs)."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from gradaccel.recompute.frames import Frame, Saved, TraceFrame
from gradaccel.recompute.offload_frame import OffloadFrame
from gradaccel.recompute.plan import make_plan
from gradaccel.recompute.roles import Source
from gradaccel.recompute.state import STATE
from gradaccel.recompute.trace import Graph
from gradaccel.recompute.checkpoint import reset_plans
from gradaccel.recompute.offload import ActivationStore


@pytest.fixture(autouse=True)
def _fresh_state():
    yield
    reset_plans()  # an OffloadFrame notes itself in the registry


def region(x, w):
    return (x @ w).relu().exp().sum(-1)  # mm saves x and w; relu and exp save their outputs


def inputs(rows=4):
    torch.manual_seed(0)
    return [torch.randn(rows, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)]


def run(frame, args):
    """Runs ``region`` under ``frame``'s hooks; returns its output and, per saved tensor, what
    the pack hook returned and a copy of the tensor."""
    packed = []

    def pack(t):
        x = frame.pack(t)
        packed.append((x, t.detach().clone()))
        return x

    with saved_tensors_hooks(pack, frame.unpack):
        if isinstance(frame, TraceFrame):
            with frame.recorder:
                out = region(*args)
        else:
            out = region(*args)
    return out, packed


def traced():
    args = inputs()
    frame = TraceFrame(Graph(args, preserve_rng_state=True), args, rng=None)
    out, packed = run(frame, args)
    assert frame.finish(out)
    return frame, out, packed


def test_the_traced_call_drops_what_replay_can_rebuild():
    frame, out, packed = traced()
    graph = frame.graph
    assert len(packed) == 4  # x, w, relu's output, exp's output
    for k, (x, _) in enumerate(packed):
        made_inside = graph.storages[graph.packs[k].storage].creator >= 0
        assert (type(x) is int) == made_inside  # the arguments are kept as they are
    for x, original in packed:
        assert torch.equal(frame.unpack(x), original)


@pytest.mark.parametrize("keep", ["nothing", "relu", "everything"])
def test_a_planned_call_keeps_what_the_plan_keeps_and_rebuilds_the_rest(keep):
    graph = traced()[0].graph
    relu_bytes = 4 * 16 * 4
    budget = {"nothing": 0, "relu": relu_bytes, "everything": graph.activation_bytes}[keep]
    plan = make_plan(graph, budget)
    assert plan.kept_bytes == budget and plan.fits
    args = inputs()
    frame = Frame(plan, args, rng=None)
    out, packed = run(frame, args)
    assert frame.finish(out)
    assert [isinstance(x, Saved) for x, _ in packed] == plan.keep
    assert sum(not k for k in plan.keep) == {"nothing": 2, "relu": 1, "everything": 0}[keep]
    for x, original in packed:
        assert torch.equal(frame.unpack(x), original)


def test_a_call_that_saves_other_tensors_keeps_them_and_says_so():
    plan = make_plan(traced()[0].graph, 0)
    args = inputs(rows=5)  # other shapes than the trace's
    frame = Frame(plan, args, rng=None)
    out, packed = run(frame, args)
    assert not frame.finish(out) and frame.diverged
    assert all(isinstance(x, Saved) for x, _ in packed)


def test_a_kept_tensor_modified_in_place_is_refused_at_unpack():
    t = torch.randn(3)
    saved = Saved(t)
    t.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.unpack()


@pytest.mark.parametrize("copy_cost", [1e-9, 16.0], ids=["all-offloaded", "replay-reads-offloaded"])
def test_an_offload_frame_lets_go_of_what_it_fetched_once_unpacked(copy_cost):
    plan = make_plan(traced()[0].graph, 0, offload_cost_per_byte=copy_cost)
    replay_reads_it = any(src.source is Source.OFFLOAD for src in plan.leaf_sources.values())
    assert plan.offloaded and bool(plan.steps) == replay_reads_it == (copy_cost > 1)
    store, args = ActivationStore(), inputs()
    frame = OffloadFrame(plan, args, None, store)
    out, packed = run(frame, args)
    assert frame.finish(out)
    for _ in range(2):  # a backward that runs again (retain_graph) fetches again: the handles stay
        for x, original in reversed(packed):
            assert torch.equal(frame.unpack(x), original)
        # Backward holds what it unpacked; the frame holds no fetched copy for it any more.
        assert frame.fetched == {} and not set(frame.leaves) & plan.offloaded
    assert store.stats()["handles"] == len(plan.offloaded)


def test_an_offload_frame_sends_storages_to_the_store_and_brings_them_back():
    plan = make_plan(traced()[0].graph, 0, offload_cost_per_byte=1e-9)  # copies priced as free
    assert plan.offloaded and plan.steps == []
    store, args = ActivationStore(), inputs()
    frame = OffloadFrame(plan, args, None, store)
    out, packed = run(frame, args)
    assert frame.finish(out) and STATE.previous_offload() is frame
    assert store.stats()["handles"] == len(plan.offloaded)
    for x, original in packed:
        assert torch.equal(frame.unpack(x), original)
