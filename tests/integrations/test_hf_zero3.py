"""gradaccel.hf.enable under DeepSpeed ZeRO-3, launched as a user launches it:
``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2`` (CPU, gloo). The rank script,
tests/integrations/hf_zero3_ranks.py, runs every scenario in one launch against stock ZeRO-3 with
Hugging Face's checkpointing: the Trainer (full fine-tune, LoRA on every projection; uneven
lengths, accumulation 4, clipping), an accelerate loop with a DeepSpeedPlugin at stage 3, the
measured peak at budget 0.5, and the NVMe refusal. Skipped where deepspeed is not installed."""

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from _dist import torchrun  # noqa: E402

HERE = Path(__file__).parent
SCENARIOS = ["full", "lora", "accelerate", "peak", "refused"]
TIMEOUT_S = 420  # the launch; ~75 s on 2 idle cores


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun(HERE / "hf_zero3_ranks.py", tmp_path_factory.mktemp("hf_zero3"), TIMEOUT_S, DS_ACCELERATOR="cpu")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_processes_zero3(results, scenario):
    for rank, res in enumerate(results):
        assert res.get(scenario) == "ok", f"rank {rank}:\n{res.get(scenario)}"
