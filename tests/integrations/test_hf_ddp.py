"""gradaccel.hf.enable on two processes, launched as a user launches them: ``torchrun
--nproc_per_node 2`` on a Trainer script (CPU, gloo: accelerate's MULTI_CPU, DDP). The rank script,
tests/integrations/hf_ddp_ranks.py, runs every scenario in one launch against stock DDP Trainer (or the stock
accelerate loop); here each scenario's result is read per rank. Plus the set-ups that are refused,
each naming the route that works (one process, no launch)."""

import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
accelerate = pytest.importorskip("accelerate")

from gradaccel.integrations import hf  # noqa: E402  (private parts too)
from gradaccel.integrations import hf_dist as _hf_dist  # noqa: E402

from _dist import torchrun  # noqa: E402

HERE = Path(__file__).parent
SCENARIOS = ["full", "lora", "qlora", "resume", "nonfinite", "accelerate", "diverge_accumulation",
             "diverge_raise", "diverge_timeout"]
TIMEOUT_S = 240  # the launch; the scenarios take ~60 s on 2 busy cores (one waits out a 15 s timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun(HERE / "hf_ddp_ranks.py", tmp_path_factory.mktemp("hf_ddp"), TIMEOUT_S)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_processes(results, scenario):
    for rank, res in enumerate(results):
        assert res.get(scenario) == "ok", f"rank {rank}:\n{res.get(scenario)}"


def _accelerator(kind, processes=2, **state):
    """What gradaccel reads of an accelerator, for a set-up this machine cannot launch."""
    return types.SimpleNamespace(distributed_type=kind, num_processes=processes, multi_device=False,
                                 state=types.SimpleNamespace(**state), parallelism_config=None, ddp_handler=None,
                                 scaler=None)


@pytest.mark.parametrize("kind, words", [
    ("FSDP", ["FSDP2 through accelerate", "fully_shard", "sync='window'", "DDP"]),
    ("XLA", ["XLA", "MULTI_GPU"]),
])
def test_refused_setups_name_the_route(kind, words):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if kind == "FSDP" else None
    acc = _accelerator(getattr(DistributedType, kind), fsdp_plugin=plugin)
    with pytest.raises(ValueError) as err:
        hf._enable_accelerator(acc, None)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not hasattr(acc, "_gradaccel")  # nothing patched


def test_ddp_comm_hook_refused():
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType
    acc = _accelerator(DistributedType.MULTI_CPU, fsdp_plugin=None)
    acc.ddp_handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(ValueError, match="communication hook.*once per window"):
        hf.pick(acc).check(fuse_wgrad=False)


def test_fsdp_plugin_ignored_on_cpu_is_said():
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    acc = _accelerator(DistributedType.MULTI_CPU, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    backend = hf.pick(acc)
    assert isinstance(backend, _hf_dist.DataParallel)
    with pytest.warns(UserWarning, match="FSDP plugin was given.*data parallelism"):
        backend.say(None)


def test_batchnorm_refused():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match="running statistics.*SyncBatchNorm"):
        _hf_dist.replicate(model)
