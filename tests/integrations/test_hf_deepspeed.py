"""gradaccel.hf.enable under DeepSpeed ZeRO-2 and ZeRO-3, launched as a user launches it:
``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2`` on a Trainer script with ``deepspeed=`` (CPU,
gloo). The rank scripts, tests/integrations/hf_deepspeed_ranks.py (ZeRO-2) and hf_zero3_ranks.py
(ZeRO-3), run every scenario in one launch each against stock DeepSpeed with Hugging Face's
checkpointing; here each scenario's result is read per rank. Plus what is refused or said, on
accelerators this machine cannot launch (one process, no launch). Skipped where deepspeed is not installed (the ``[deepspeed]``
extra; ``make test`` installs it)."""

import types
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from gradaccel.integrations import hf  # noqa: E402  (private parts too)
from gradaccel.integrations import hf_deepspeed  # noqa: E402

from _dist import torchrun  # noqa: E402

HERE = Path(__file__).parent
# One torchrun launch per rank script, its scenarios read per rank: ZeRO-2 (hf_deepspeed_ranks.py,
# ~70 s on 2 busy cores) and ZeRO-3 (hf_zero3_ranks.py: the Trainer, full and LoRA; an accelerate
# loop with a DeepSpeedPlugin at stage 3; the peak at budget 0.5; NVMe refused; checkpoint_blocks'
# memory= under the Trainer; ~130 s).
LAUNCHES = {"zero2": ("hf_deepspeed_ranks.py", ["full", "lora", "bf16", "accelerate", "refused"]),
            "zero3": ("hf_zero3_ranks.py", ["full", "lora", "accelerate", "peak", "refused", "memory"])}
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    done = {}

    def results(launch):
        if launch not in done:
            script = LAUNCHES[launch][0]
            done[launch] = torchrun(HERE / script, tmp_path_factory.mktemp(launch), TIMEOUT_S, DS_ACCELERATOR="cpu")
        return done[launch]
    return results


@pytest.mark.parametrize("launch, scenario", [(k, s) for k, (_, names) in LAUNCHES.items() for s in names])
def test_two_processes(launched, launch, scenario):
    for rank, res in enumerate(launched(launch)):
        assert res.get(scenario) == "ok", f"rank {rank}:\n{res.get(scenario)}"


def _accelerator(config, mixed_precision="no"):
    """What gradaccel reads of an accelerator under DeepSpeed."""
    from accelerate.utils import DistributedType
    plugin = types.SimpleNamespace(deepspeed_config=config)
    acc = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2, mixed_precision=mixed_precision,
                                state=types.SimpleNamespace(deepspeed_plugin=plugin), scaler=None)
    acc.prepare = lambda *args, device_placement=None: args
    return acc


@pytest.mark.parametrize("config, words", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     ["ZeRO-3", "NVMe", '"offload_param": {"device": "cpu"}', "Hugging Face's own checkpointing"]),
    ({"zero_optimization": {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True}},
     ["cpu_checkpointing", "deepspeed.checkpointing.checkpoint", "gradient_checkpointing=True", "offload=True"]),
])
def test_refused_name_what_works(config, words):
    acc = _accelerator(config)
    with pytest.raises(ValueError) as err:
        hf._enable_accelerator(acc, 0.5)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not hasattr(acc, "_gradaccel")  # nothing patched


@pytest.mark.parametrize("config, mixed, accum", [
    ({"zero_optimization": {"stage": 2}}, "no", "fp32"),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}, "no", "bf16"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}, "bf16", "bf16"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, "no", "fp32"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, "no", "fp16"),
    ({"zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "fp32"}}, "no", "fp32"),
])
def test_split_said_once_naming_fp32_accumulation(config, mixed, accum):
    acc = _accelerator(config, mixed)
    with pytest.warns(UserWarning) as said:
        hf._enable_accelerator(acc, 0.5)
        hf._enable_accelerator(acc, 0.25)  # again (a new budget): nothing more said
    msgs = [str(w.message) for w in said if "gradaccel.hf.enable under DeepSpeed" in str(w.message)]
    assert len(msgs) == 1, msgs
    stage = config.get("zero_optimization", {}).get("stage", 0)
    assert f"ZeRO-{stage}" in msgs[0] and "DeepSpeed keeps the gradient" in msgs[0] and f"(in {accum})" in msgs[0]
    assert (hf_deepspeed.FP32_ACCUM in msgs[0]) == (accum != "fp32"), msgs[0]
    assert ("GatheredParameters" in msgs[0]) == (stage == 3), msgs[0]
    state = acc._gradaccel
    assert not state.backend.owns_gradient and state.budget == 0.25 and not state.fused()
