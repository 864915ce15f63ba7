"""`python -m bench` end to end on fake suites (seconds), and each real suite on its tiny setting."""

import csv
import json
import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from bench import __main__ as cli
from bench import common, report

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _fake_suite(name: str, *, fail: str | None = None, baseline=None) -> types.ModuleType:
    """A suite with two cases, a declared or implicit baseline, progress calls and one plot."""

    def run(device, quick):
        assert quick and common.tiny(), "the CLI's --tiny must reach suites as common.tiny()"
        rows = []
        for i, case in enumerate(["small", "large"], 1):
            common.progress(case, i, 2)
            if fail == "run" and i == 2:
                raise RuntimeError(f"{name} blew up in case {case}")
            base = "torch-add" if baseline else "torch"
            rows += [common.row(name, case, base, "time", 2.0 * i, "s", device),
                     common.row(name, case, "gradaccel", "time", 1.0 * i, "s", device),
                     common.row(name, case, "gradaccel-fused", "time", 0.5 * i, "s", device),
                     common.row(name, case, base, "bytes", 26.0, "B/param", device),
                     common.row(name, case, "gradaccel", "bytes", 10.0, "B/param", device)]
        if fail == "rows":
            rows.append({"suite": name, "case": "x", "variant": "gradaccel"})
        return rows

    def plot(rows, out_dir):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        for v in sorted({r["variant"] for r in rows}):
            ax.plot([r["value"] for r in rows if r["variant"] == v and r["metric"] == "time"], label=v)
        ax.set(xlabel="case", ylabel="time (s)")
        ax.legend()
        path = os.path.join(out_dir, f"{name}_time.png")
        fig.savefig(path)
        plt.close(fig)
        return [path]

    mod = types.ModuleType(f"bench.{name}")
    mod.run, mod.plot = run, plot
    if baseline:
        mod.BASELINE = baseline
    return mod


@pytest.fixture
def fakes(monkeypatch):
    """Installs fake suites as bench.<name>, and keeps the CLI's env changes inside the test."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv(common.TINY_ENV, "0")

    def install(name, **kw):
        monkeypatch.setitem(sys.modules, f"bench.{name}", _fake_suite(name, **kw))

    return install


def _read_outputs(out: Path):
    rows = json.loads((out / "results.json").read_text())
    with open(out / "results.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    return rows, csv_rows, (out / "report.md").read_text()


def test_cli_end_to_end(fakes, tmp_path, capsys):
    fakes("fakea", baseline=["torch-add"])
    fakes("fakeb")
    out = tmp_path / "out"
    assert cli.main(["--suite", "fakea,fakeb", "--device", "cpu", "--tiny", "--out", str(out)]) == 0
    rows, csv_rows, md = _read_outputs(out)

    assert len(rows) == 20 and {r["suite"] for r in rows} == {"fakea", "fakeb"}
    for r in rows:
        assert tuple(r) == report.FIELDS
        assert isinstance(r["value"], float) and r["device"] == "cpu"
    assert [tuple(r) for r in csv_rows] == [report.FIELDS] * len(rows)
    for r, c in zip(rows, csv_rows):
        assert {k: v for k, v in c.items() if k != "value"} == {k: v for k, v in r.items() if k != "value"}
        assert float(c["value"]) == r["value"]

    # One table per suite; ours as ratios to the baseline, which shows its own value.
    for suite, base in [("fakea", "torch-add"), ("fakeb", "torch")]:
        assert f"## {suite}\n" in md and f"`{base}`" in md
    assert "| small | time | s | 2 | 0.500x | 0.250x |" in md
    assert "| large | bytes | B/param | 26 | 0.385x |  |" in md
    for key in ("date", "machine", "cpu", "gpu", "python", "torch", "triton", "git"):
        assert f"| {key} | " in md
    for suite in ("fakea", "fakeb"):
        png = out / f"{suite}_time.png"
        assert png.read_bytes()[:8] == PNG and f"]({png.name})" in md
    assert "Failures" not in md

    # A second run into the same directory replaces the first one's plots, and only those.
    (out / "mine.png").write_bytes(PNG)
    fakes("fakea", baseline=["torch-add"])
    assert cli.main(["--suite", "fakea", "--device", "cpu", "--tiny", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["fakea_time.png", "mine.png"]

    captured = capsys.readouterr()
    assert "[bench 1/2] fakea: [#####.....] 1/2 small" in captured.err
    assert "[bench 2/2] fakeb: done, 10 rows, 1 plots" in captured.err
    assert "## fakeb" in captured.out and "0.250x" in captured.out


def test_a_failing_suite_keeps_the_others(fakes, tmp_path, capsys):
    fakes("fakeok")
    fakes("fakeboom", fail="run")
    fakes("fakebad", fail="rows")
    out = tmp_path / "out"
    rc = cli.main(["--suite", "fakeok,fakeboom,fakebad,nosuchsuite", "--device", "cpu", "--tiny",
                   "--out", str(out)])
    assert rc == 1
    rows, csv_rows, md = _read_outputs(out)
    # The malformed row is dropped, the well-formed ones of the same suite are kept.
    assert {r["suite"] for r in rows} == {"fakeok", "fakebad"} and len(rows) == len(csv_rows) == 20
    failures = md.split("## Failures", 1)[1]
    assert "fakeboom blew up in case large" in failures and "RuntimeError" in failures
    assert "row 10 dropped" in failures and "no suite 'nosuchsuite'" in failures
    assert "### fakeok" not in failures and "## fakeok\n" in md
    err = capsys.readouterr().err
    assert "fakeboom: FAILED (0 rows kept): RuntimeError: fakeboom blew up" in err
    assert "FAILED suites: fakeboom, fakebad, nosuchsuite" in err


def test_python_dash_m_bench(tmp_path):
    """The real entry point, in its own process, with suites from a module outside bench/."""
    pkg = tmp_path / "fakesuites"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ok.py").write_text(textwrap.dedent("""
        from bench.common import row, progress
        def run(device, quick):
            progress("only")
            return [row("ok", "only", "torch", "time", 2.0, "s", device),
                    row("ok", "only", "gradaccel", "time", 1.0, "s", device)]
        def plot(rows, out_dir):
            return []
    """))
    (pkg / "boom.py").write_text("def run(device, quick):\n    raise ValueError('boom')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench", "--suite", "fakesuites.ok,fakesuites.boom",
                        "--device", "cpu", "--tiny", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "ValueError: boom" in p.stderr and "| only | time | s | 2 | 0.500x |" in p.stdout
    assert [r["suite"] for r in json.loads((out / "results.json").read_text())] == ["ok", "ok"]


def test_cuda_refused_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["--suite", "x", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bad_threads_or_out_are_usage_errors(tmp_path, capsys):
    assert cli.main(["--suite", "x", "--device", "cpu", "--threads", "-1", "--out", str(tmp_path)]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli.main(["--suite", "x", "--device", "cpu", "--out", str(a_file)]) == 2
    assert "cannot use --out" in capsys.readouterr().err


def test_default_set_and_all(tmp_path, capsys):
    """`make bench` runs the default set (accumulate, checkpoint, train: the first table in minutes),
    `--all` (`make bench-all`) every suite; `make results` publishes whole CPU runs only."""
    assert cli.parse_args([]).suites == list(cli.DEFAULT_SUITES) == ["accumulate", "checkpoint", "train"]
    assert cli.parse_args(["--all"]).suites == list(cli.SUITES) and set(cli.DEFAULT_SUITES) < set(cli.SUITES)
    with pytest.raises(SystemExit):
        cli.parse_args(["--all", "--suite", "fit"])
    assert "not allowed with argument" in capsys.readouterr().err
    for suites, refused in ((cli.DEFAULT_SUITES, True), (cli.SUITES, False)):
        rows = [common.row(s, "c", "torch", "time", 1.0, "s", "cpu") for s in suites]
        (tmp_path / "results.json").write_text(json.dumps(rows))
        assert report.partial_run(tmp_path, "make results") == refused
    assert "lacks finetune, distributed" in capsys.readouterr().err


def test_pick_baseline():
    assert report.pick_baseline(["torch", "torch-ckpt", "gradaccel"], None) == "torch"
    assert report.pick_baseline(["torch-ckpt", "gradaccel"], None) == "torch-ckpt"
    assert report.pick_baseline(["torch-a", "torch-b", "gradaccel"], None) is None
    assert report.pick_baseline(["torch-a", "torch-b"], "torch-b") == "torch-b"
    assert report.pick_baseline(["torch-a", "torch-b"], ["torch-c", "torch-a"]) == "torch-a"
    assert report.pick_baseline(["torch-a"], "torch-c") is None


def test_table_plain_values_and_metric_filter():
    rows = [common.row("s", "c", "torch", "time", 0.0, "s", "cpu"),
            common.row("s", "c", "gradaccel", "time", 3.0, "s", "cpu"),
            common.row("s", "c", "gradaccel", "loss@1", 1.0, "", "cpu"),
            common.row("s", "d", "gradaccel", "time", 4.0, "s", "cpu")]
    table = report.suite_table(rows)
    assert "| c | time | s | 0 | =3 |\n| c | loss@1 |  |  | =1 |\n" in table
    # Case d has other variants: a table of its own, without empty columns.
    assert "\n\n| case | metric | unit | gradaccel |\n|---|---|---|---:|\n| d | time | s | =4 |\n" in table
    assert "loss@1" not in report.suite_table(rows, metrics=["time"])


def test_check_rows():
    good = [common.row("s", "c", "torch", "time", 1.0, "s", "cuda:0"),
            common.row("s", "c", "gradaccel", "time", math.nan, "s", "cuda")]
    rows, problems = report.check_rows(good, "s", "cuda")
    assert rows == good and len(problems) == 1 and "value is nan" in problems[0]
    bad = [common.row("t", "c", "torch", "time", 1.0, "s", "cpu"),
           common.row("s", "c", "gradaccel", "time", 1.0, "s", "cuda"),
           common.row("s", "c", "mine", "time", 1.0, "s", "cpu"),
           {**common.row("s", "c", "torch", "time", 1.0, "s", "cpu"), "value": "1"}]
    rows, problems = report.check_rows(bad, "s", "cpu")
    assert rows == [] and len(problems) == 6
    assert report.check_rows(None, "s", "cpu") == ([], ["run() returned NoneType, not a list of rows"])


def test_results_md_sections(tmp_path):
    def report_md(device, value):
        env = {"date": "2026-01-02T03:04:05+00:00", "cpu": "Some CPU", "device": device,
               "gpu": "H100" if device == "cuda" else "none used"}
        table = report.suite_table([common.row("s", "c", "torch", "time", value, "s", device),
                                    common.row("s", "c", "gradaccel", "time", 1.0, "s", device)])
        path = tmp_path / f"report-{device}-{value}.md"
        path.write_text(report.render_report(env, {"s": table}, {}, {}, "python -m bench"))
        return path

    target = tmp_path / "RESULTS.md"
    target.write_text("# Results\n\nHow these are made.\n")
    assert report.update_results_md(report_md("cpu", 2.0), target) == "cpu"
    report.update_results_md(report_md("cuda", 4.0), target)
    report.update_results_md(report_md("cpu", 8.0), target)
    text = target.read_text()
    assert text.startswith("# Results\n\nHow these are made.\n") and "\n### s\n" in text
    assert text.count("<!-- bench:cpu:start -->") == 1 and text.count("<!-- bench:cuda:end -->") == 1
    assert "## CPU: Some CPU, 2026-01-02" in text and "## GPU: H100, 2026-01-02" in text
    assert "| c | time | s | 8 | 0.125x |" in text and "| 2 | 0.500x |" not in text
    assert "| c | time | s | 4 | 0.250x |" in text


def test_headline_is_copied_from_a_run(tmp_path):
    from bench import headline

    rows = [common.row("checkpoint", "gpt", v, m, x, u, "cpu") for v, m, x, u in (
        ("torch-none", "held_bytes", 100.0, "B"), ("torch-full", "held_bytes", 2.0, "B"),
        ("gradaccel-b0.5", "held_bytes", 50.0, "B"), ("torch-none", "time", 1.0, "s"))]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    (tmp_path / "report.md").write_text("| date | 2026-01-02T03:04:05+00:00 |\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{headline.START}\nold\n{headline.END}\nafter\n")
    headline.update(tmp_path, readme)
    text = readme.read_text()
    assert "old" not in text and text.endswith("after\n") and "2026-01-02" in text
    assert "| gpt | torch-none: 100 B | torch-full: 0.0200x | gradaccel-b0.5: 0.500x |" in text
    assert "step time" not in text  # no gradaccel row for time: the line is left out


@pytest.mark.parametrize("name", cli.SUITES + ("offload", "fit_sweep"))
def test_real_suite_tiny(name, tmp_path, monkeypatch):
    """Each suite's own code on its tiny setting; turns on by itself once bench/<name>.py exists."""
    if not (REPO / "bench" / f"{name}.py").exists():
        pytest.skip(f"bench/{name}.py not written yet")
    monkeypatch.setenv(common.TINY_ENV, "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    mod = cli.load_suite(name)
    cases = []
    common.set_progress_hook(lambda case, i=None, n=None: cases.append(case))
    try:
        rows = mod.run("cpu", True)
    finally:
        common.set_progress_hook(None)
    rows, problems = report.check_rows(rows, name, "cpu")
    assert not problems, problems
    paths = mod.plot(rows, str(tmp_path))
    assert paths, f"bench/{name}.py plot() wrote no PNG"
    for p in paths:
        assert Path(p).read_bytes()[:8] == PNG, p


def test_ratio_format():
    assert [report.fmt_ratio(r) for r in (1.0, 0.385, 2.039, 99.96, 1234.0, math.inf)] == \
        ["1.00x", "0.385x", "2.04x", "100x", "1234x", "n/a"]


def test_gpu_layer_times_run_on_cpu():
    """bench/wgrad_gpu.py's whole-layer timing (run on a GPU by bench/gpu.sh), on tiny CPU layers:
    each variant is timed, and the routed variant's layers really are routed."""
    import torch

    from bench.wgrad_gpu import layer_times

    t = layer_times("cpu", torch.float32, 8, {"pair": ((8, 4), (4, 8))}, reps=1)
    assert set(t["pair"]) == {"stock", "fold", "fused"} and all(s > 0 for s in t["pair"].values())
