"""gradaccel.fit as a user meets it: the command line's help and its answers to bad input, hub ids,
presets, the longest sequence that fits (``max_seq`` / ``--max-seq``), the table (aligned, the
peak's phase in words, each option with the call and flag that take it), one story between advice
and options, nothing on stderr, and the ``memory=`` target's warning at every length where it
cannot be met."""

import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from gradaccel.memory import fit_cli, fixed_parts  # noqa: E402
from gradaccel.memory.counter import format_bytes  # noqa: E402
from gradaccel.memory.fit import PRESETS, Planner, _least, load_config, memory_and_slack  # noqa: E402
from gradaccel.memory.fit_cli import _parser, main  # noqa: E402
from gradaccel.memory.longest import longest, max_seq  # noqa: E402


def _tiny_config(layers=4):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


@pytest.mark.parametrize("args, says", [
    (["--seq", "-5"], "--seq must be an int >= 1"),
    (["--seq", "abc"], "--seq must be an int >= 1"),
    (["--seq", "128", "--memory", "lots"], "argument --memory: needs a unit"),
    (["--seq", "128", "--memory", "24"], "argument --memory: needs a unit, such as 24GiB"),  # not 24 bytes
    (["--seq", "128", "--memory", "0"], "argument --memory: must be at least 1.00 MiB"),
    (["--seq", "128", "--memory", "512KiB"], "argument --memory: must be at least 1.00 MiB"),
    (["--seq", "128", "--memory", "24 apples"], "argument --memory: unknown unit in '24 apples'"),
    (["--seq", "128", "--slack", "12"], "argument --slack: needs a unit"),
    (["--seq", "128", "--model", "./missing/config.json"], "model './missing/config.json': file not found"),
    (["--seq", "128", "--model", "missing/config.json"], "model 'missing/config.json': file not found"),
    (["--seq", "128", "--option", "0"], "--option must be an int >= 1"),
    (["--seq", "128", "--batch", "0"], "--batch must be an int >= 1"),
    (["--seq", "128", "--model", "no-such-model"], "model must be a preset"),
    (["--seq", "128", "--max-seq"], "give --seq or --max-seq"),
    ([], "give --seq or --max-seq"),
])
def test_bad_input_is_one_line_and_status_2(args, says, capsys):
    argv = ["--model", "llama-3-8b", "--memory", "24GiB"] + args
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m gradaccel.fit: error: ") and says in err
    assert "Traceback" not in err


def test_every_flag_has_help_with_its_default():
    """Each flag says what it is and, unless it is required or the alternative to another, its
    default; --slack's default is the one memory_and_slack applies."""
    for action in _parser()._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        if not action.required and action.dest not in ("seq", "max_seq"):
            assert "default" in action.help, action.option_strings
    slack = next(a.help for a in _parser()._actions if a.dest == "slack")
    assert "5%% of --memory, plus 512MiB where --memory is over 4GiB" in slack
    for gib, extra in ((1, 0), (4, 0), (8, 512 << 20), (24, 512 << 20)):
        assert memory_and_slack(f"{gib}GiB")[1] == (gib << 30) // 20 + extra


def test_hub_id_offline_is_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fixed_parts, "_reachable", lambda url, timeout=3.0: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing cached
    with pytest.raises(ValueError, match="not reachable and it is not in the local cache"):
        load_config("someone/some-model")
    with pytest.raises(SystemExit) as e:
        main(["--model", "someone/some-model", "--seq", "128", "--memory", "24GiB"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "someone/some-model" in err


def test_hub_id_reads_its_config_json(monkeypatch, tmp_path):
    """Where the hub answers, only config.json is fetched (huggingface_hub's download, mocked)."""
    path = tmp_path / "config.json"
    path.write_text(_tiny_config().to_json_string())
    asked = []

    def download(repo_id, filename, local_files_only=False):
        asked.append((repo_id, filename))
        return str(path)

    import huggingface_hub

    monkeypatch.setattr(fixed_parts, "_reachable", lambda url, timeout=3.0: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    config = load_config("someone/tiny-llama")
    assert asked == [("someone/tiny-llama", "config.json")]
    assert config.hidden_size == 64 and config.num_hidden_layers == 4


# Parameter counts the model cards publish (billions, to the digits they give).
_PUBLISHED = {"mistral-7b": 7.25, "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.62,
              "gemma-2-2b": 2.61, "gemma-2-9b": 9.24, "phi-3-mini": 3.82, "llama-3-8b": 8.03, "llama-3.2-1b": 1.24}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_presets_have_the_published_sizes(name):
    config = load_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert round(count, 2) == _PUBLISHED[name], count


def test_lora_on_fused_projections():
    """Phi-3's fused qkv_proj and gate_up_proj get adapters, as peft's all-linear gives them."""
    planner = Planner("phi-3-mini", lora=8)
    block = fixed_parts.find_blocks(planner.model)[0]
    wrapped = {n.split(".")[-1] for n, m in block.named_modules() if isinstance(m, fixed_parts.LoRALinear)}
    assert wrapped == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert set(PRESETS) >= {"mistral-7b", "qwen2.5-7b", "gemma-2-9b", "phi-3-mini"}


def test_max_seq_is_the_longest_that_fits(tmp_path, capsys):
    planner = Planner(_tiny_config(), lora=4)
    memory, granule = 24 << 20, 64
    best = longest(planner, memory, slack=0, granule=granule)
    assert best.fits and best.seq % granule == 0 and best.peak <= memory
    assert not planner.fit(best.seq + granule, 1, memory, slack=0).fits
    assert best.longer is not None and best.longer[0] >= best.seq + granule and best.longer[1] > memory
    assert best.seq >= 1024  # the search went past its first probes
    # The command line: the same answer first, then its plan (modes per block, host, step time).
    path = tmp_path / "config.json"
    path.write_text(_tiny_config().to_json_string())
    assert main(["--model", str(path), "--memory", "24MiB", "--slack", "0", "--lora", "4",
                 "--max-seq", "--granule", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"longest sequence that fits in 24.00 MiB: {best.seq} tokens")
    assert "step time" in out[0] and "host" in out[0]  # copy speed is measured per process: time varies
    assert out[1].startswith(f"micro-batch 1 x 1 accumulation steps, sequence {best.seq}")
    assert out[2].startswith("blocks: 0")


def test_max_seq_api_when_nothing_fits():
    result = max_seq(_tiny_config(2), 1 << 20, slack=0, granule=64)
    assert not result.fits and result.seq == 64


def _figures(line):
    return re.findall(r"device peak ([0-9.]+ [KMG]i?B)", line)


def test_advice_and_options_tell_one_story():
    """Each plan the output names is printed with its own peak, once: the fitted plan, an
    option (faster, with offload) with the peak that option has, and where nothing fits the
    least offload plan in the advice with that plan's peak, never beside an option."""
    planner = Planner(_tiny_config(8), optim="sgd", dtype=torch.float32)
    seq = 256
    least_plain = min(_least(planner, seq, 1, False, h).peak for h in (False, True))
    least_off = min(_least(planner, seq, 1, True, h).peak for h in (False, True))
    for memory in (least_plain // 2, (least_plain + least_off) // 2 if least_off < least_plain else None,
                   least_plain + (least_plain >> 2), least_plain * 4):
        if memory is None:
            continue
        r = planner.fit(seq, 1, memory, slack=0)
        text = r.table()
        advice = [s for s in r.suggestions if s.startswith("offload")]
        options = [line for line in text.splitlines() if line.startswith("option ")]
        assert not (advice and options)
        for o, line in zip(r.options, options):
            assert _figures(line) == [format_bytes(o.peak)] and o.peak <= memory
        if advice:
            assert not r.fits and _figures(advice[0]) == [format_bytes(least_off)] and least_off > memory
        # Offload is advised where nothing fits and it lowers the least peak; only there.
        assert bool(advice) == (not r.fits and least_off < r.peak), (advice, least_off, r.peak)
        if r.fits:
            assert r.peak <= memory and ("offload=True" in text.splitlines()[0]) == r.offload


def _table_rows(text):
    """The table's part rows: from the "part" header to the last row with a byte figure."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("part "))
    rows = [lines[start]]
    for line in lines[start + 1:]:
        if not re.search(r" [0-9.]+ (B|KiB|MiB|GiB)$", line):
            break
        rows.append(line)
    return rows


def test_table_aligned_phase_in_words_options_taken(capsys, monkeypatch):
    """Every row of the table ends in one column; the peak's phase reads as words; each option
    line names plan.options[k].apply(...) and --option k, which prints that option's own table;
    and the option applied to the real model trains."""
    from gradaccel.recompute import offload

    # A fixed copy speed (measured per process otherwise; whether offload pays depends on it).
    monkeypatch.setattr(offload, "copy_bandwidth", lambda device: (8e9, 8e9))
    planner = Planner(_tiny_config(8), optim="sgd", dtype=torch.float32)
    least = min(_least(planner, 256, 1, False, h).peak for h in (False, True))
    memory = least + least // 4  # here the fit offers offload and the inputs on the host
    result = planner.fit(256, 1, memory, slack=0)
    text = result.table()
    rows = _table_rows(text)
    assert len(rows) >= 8 and len({len(row) for row in rows}) == 1, rows  # one right edge
    (peak,) = [row for row in rows if row.startswith("predicted peak")]
    assert re.match(r"predicted peak, at (forward|backward) of block \d+ |predicted peak, at the ", peak), peak
    assert "('" not in text
    options = [line for line in text.splitlines() if line.startswith("option ")]
    assert len(options) == len(result.options) >= 1, text
    for k, line in enumerate(options, 1):
        assert f"plan.options[{k - 1}].apply(model, optimizer)" in line and f"--option {k} " in line
    # The command line prints that table, and --option k the k-th option's. (The plan itself is
    # this one: a fresh fit may choose otherwise, as the planner's choice between plans that
    # cost nearly the same can move from one process, or one fit, to the next.)
    monkeypatch.setattr(fit_cli, "fit", lambda *args, **kwargs: result)
    argv = ["--model", "llama-3-8b", "--seq", "256", "--memory", f"{memory}B", "--slack", "0"]
    assert main(argv) == 0
    assert capsys.readouterr().out == text + "\n"
    k = len(result.options)
    assert main(argv + ["--option", str(k)]) == 0
    assert capsys.readouterr().out == result.options[k - 1].table() + "\n"
    with pytest.raises(SystemExit):
        main(argv + ["--option", str(k + 1)])
    assert f"--option {k + 1}: this plan has {k} option(s)" in capsys.readouterr().err
    # The call the option line names installs that plan on the real model.
    gradaccel.reset_plans()
    model = transformers.LlamaForCausalLM(_tiny_config(8)).train()
    model, opt = result.options[0].apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 1000, (1, 256))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert opt.step() is True


@pytest.mark.parametrize("offline", ["0", "1"])
def test_sizing_prints_nothing_else(tmp_path, offline):
    """A 4-bit fit with bitsandbytes' paged 8-bit AdamW prints the table and nothing on stderr:
    bitsandbytes is imported (for its optimizer class only) with its kernel notices quieted,
    online (it cannot check a kernel's publisher) and with the Hub offline (it skips the check)."""
    pytest.importorskip("bitsandbytes")
    path = tmp_path / "config.json"
    path.write_text(_tiny_config(2).to_json_string())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's own filters, as a user has
    env["PYTHONPATH"] = str(pathlib.Path(gradaccel.__file__).parents[1])
    env["HF_HUB_OFFLINE"] = offline
    proc = subprocess.run([sys.executable, "-m", "gradaccel.fit", "--model", str(path), "--seq", "64", "--memory",
                           "64MiB", "--lora", "4", "--load-in-4bit", "--optim", "paged_adamw8bit"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("micro-batch"), proc.stdout + proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (17, 3), (1, 1), (1024, 4099)])
def test_nf4_bytes_are_bitsandbytes_own(shape):
    """The nf4 size by formula (which lets sizing leave bitsandbytes unimported) equals what
    bitsandbytes' quantize_4bit stores: the packed weight and every tensor of its QuantState."""
    F = pytest.importorskip("bitsandbytes.functional")
    from gradaccel.memory.counter import storage_bytes
    from gradaccel.memory.profile import fake_mode

    F.quantize_4bit(torch.ones(64), blocksize=64, compress_statistics=True, quant_type="nf4")  # fills its cache
    with fake_mode():
        q, qs = F.quantize_4bit(torch.empty(shape, dtype=torch.bfloat16), blocksize=64, compress_statistics=True,
                                quant_type="nf4", quant_storage=torch.uint8)
        measured = storage_bytes([q] + fixed_parts._quant_state_tensors(qs))
    assert fixed_parts.nf4_bytes(shape, torch.bfloat16) == measured


def test_memory_target_below_the_least_warns_at_every_length():
    """Each length whose least plan is over the target is warned about once, naming the least
    peak and the shortfall (seq=: the longest length is planned, and warned about, at the first
    call)."""
    gradaccel.reset_plans()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_config(2)).train()
    gradaccel.checkpoint_blocks(model, memory=1, seq=192)
    warned = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in (64, 128, 192, 128):
            ids = torch.randint(0, 1000, (1, seq))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for w in caught:
        found = re.search(r"\((\d+) bytes, predicted on fake tensors; short by (\d+) bytes\) at input shape "
                          r"\(\(\(1, (\d+)\)", str(w.message))
        if found:
            least, short, length = map(int, found.groups())
            assert short == least - 1 and length not in warned
            warned[length] = least
    assert sorted(warned) == [64, 128, 192]
    assert warned[64] < warned[128] < warned[192]
