"""Everything `python -m bench` writes: row checks, ratio tables, results files, report.md.

Also renders report.md into a dated section of bench/RESULTS.md (or any file carrying the same
markers, such as the README), so published numbers are copied from a run, never typed::

    python -m bench.report bench/results/latest --results-md bench/RESULTS.md
"""

import argparse
import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

FIELDS = ("suite", "case", "variant", "metric", "value", "unit", "device")
REPO = Path(__file__).resolve().parents[1]

# report.md keeps what RESULTS.md publishes (environment and tables) between these markers.
_KEEP_START, _KEEP_END = "<!-- results:start -->", "<!-- results:end -->"


# --- rows ---------------------------------------------------------------------------------------

def check_rows(rows: object, suite: str, device: str) -> tuple[list[dict], list[str]]:
    """Split what a suite's ``run`` returned into usable rows and a list of problems.

    A row is usable when it has exactly the fields of ``bench.common.row`` with the right types,
    names this suite and this device (``cuda:1`` counts as ``cuda``). A non-finite value keeps
    its row but is a problem. So is a suite without both a ``torch…`` and a ``gradaccel…`` variant.
    """
    if not isinstance(rows, (list, tuple)):
        return [], [f"run() returned {type(rows).__name__}, not a list of rows"]
    good, problems = [], []
    for k, r in enumerate(rows):
        why = _row_problem(r, suite, device)
        if why is None:
            good.append(r)
            if not math.isfinite(r["value"]):
                problems.append(f"row {k} ({r['case']}, {r['variant']}, {r['metric']}): value is {r['value']}")
        else:
            problems.append(f"row {k} dropped: {why}: {r!r:.200}")
    variants = {r["variant"] for r in good}
    for prefix in ("torch", "gradaccel"):
        if not any(v.startswith(prefix) for v in variants):
            problems.append(f"no '{prefix}…' variant among {sorted(variants)}")
    return good, problems


def _row_problem(r: object, suite: str, device: str) -> str | None:
    if not isinstance(r, dict):
        return f"a {type(r).__name__}, not a dict"
    if set(r) != set(FIELDS):
        return f"fields {sorted(r)} are not {list(FIELDS)}"
    for f in FIELDS:
        if f != "value" and not isinstance(r[f], str):
            return f"'{f}' is not a string"
    if isinstance(r["value"], bool) or not isinstance(r["value"], (int, float)):
        return "'value' is not a number"
    if r["suite"] != suite:
        return f"suite is '{r['suite']}', expected '{suite}'"
    if r["device"].split(":")[0] != device:
        return f"device is '{r['device']}', the run is on '{device}'"
    if not r["variant"].startswith(("torch", "gradaccel")):
        return f"variant '{r['variant']}' starts with neither 'torch' nor 'gradaccel'"
    return None


def write_json(rows: Sequence[dict], path: Path) -> None:
    """``rows`` as a JSON list; a non-finite value becomes ``null`` (JSON has no NaN)."""
    clean = [{**r, "value": r["value"] if math.isfinite(r["value"]) else None} for r in rows]
    path.write_text(json.dumps(clean, indent=1) + "\n")


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """``rows`` as CSV with a header line, columns in ``FIELDS`` order."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


# --- ratio tables -------------------------------------------------------------------------------

def pick_baseline(variants: Iterable[str], declared: str | Sequence[str] | None) -> str | None:
    """The variant that the others of one (case, metric) are divided by.

    ``declared`` (a suite's ``BASELINE``) is a variant name or a preference list: the first one
    present wins. Undeclared: the variant named exactly ``torch``, else the only ``torch…`` one.
    """
    present = list(variants)
    if declared is not None:
        for name in [declared] if isinstance(declared, str) else declared:
            if name in present:
                return name
        return None
    if "torch" in present:
        return "torch"
    torch_like = [v for v in present if v.startswith("torch")]
    return torch_like[0] if len(torch_like) == 1 else None


def fmt(v: float) -> str:
    """Four significant digits, so columns stay narrow whatever the unit."""
    return "n/a" if not math.isfinite(v) else f"{v:.4g}"


def fmt_ratio(r: float) -> str:
    """Three significant digits, zeros kept (``1.00x``: equal, not rounded to it)."""
    if not math.isfinite(r):
        return "n/a"
    return f"{r:.0f}x" if abs(r) >= 99.95 else f"{r:#.3g}x"


def suite_table(rows: Sequence[dict], baseline: str | Sequence[str] | None = None,
                metrics: Sequence[str] | None = None) -> str:
    """Markdown tables of one suite: a line per (case, metric), a column per variant.

    The baseline's cell holds its value; every other cell holds ``value / baseline`` as ``0.520x``,
    or the plain value (marked ``=``) where the (case, metric) has no baseline or it is zero.
    Lines go case by case, metrics in order within a case. Cases measured with the same set of
    variants share a table; a case with another set (a different kind of case) gets its own.

    Args:
        rows: the suite's rows.
        baseline: the suite's ``BASELINE`` (see :func:`pick_baseline`).
        metrics: the suite's ``TABLE_METRICS``: only these metrics, in this order; default all,
            in order of appearance.
    """
    if metrics is None:
        metrics = list(dict.fromkeys(r["metric"] for r in rows))
    metric_rank = {m: k for k, m in enumerate(metrics)}
    rows = [r for r in rows if r["metric"] in metric_rank]
    if not rows:
        return "_no rows_\n"
    case_rank = {c: k for k, c in enumerate(dict.fromkeys(r["case"] for r in rows))}
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in sorted(rows, key=lambda r: (case_rank[r["case"]], metric_rank[r["metric"]])):
        groups.setdefault((r["case"], r["metric"]), {})[r["variant"]] = r
    variant_sets: dict[str, frozenset] = {}
    for r in rows:
        variant_sets[r["case"]] = variant_sets.get(r["case"], frozenset()) | {r["variant"]}
    clusters: dict[frozenset, dict] = {}
    for key, g in groups.items():
        clusters.setdefault(variant_sets[key[0]], {})[key] = g
    return "\n".join(_table(c, baseline) for c in clusters.values())


def _table(groups: dict[tuple[str, str], dict[str, dict]], baseline) -> str:
    bases = {key: pick_baseline(g, baseline) for key, g in groups.items()}
    # Baselines first, then the other torch variants, then ours, each in order of appearance.
    seen = list(dict.fromkeys(v for g in groups.values() for v in g))
    base_names = [v for v in seen if v in set(bases.values())]
    columns = base_names + [v for v in seen if v not in base_names and v.startswith("torch")] \
        + [v for v in seen if v not in base_names and not v.startswith("torch")]
    lines = ["| case | metric | unit | " + " | ".join(columns) + " |",
             "|---|---|---|" + "---:|" * len(columns)]
    for (case, metric), g in groups.items():
        base = g.get(bases[(case, metric)]) if bases[(case, metric)] else None
        unit = (base or next(iter(g.values())))["unit"]
        cells = []
        for v in columns:
            r = g.get(v)
            if r is None:
                cells.append("")
            elif r is base:
                cells.append(fmt(r["value"]))
            elif base is not None and base["value"] != 0 and math.isfinite(base["value"]):
                cells.append(fmt_ratio(r["value"] / base["value"]))
            else:
                cells.append("=" + fmt(r["value"]))
        lines.append(f"| {case} | {metric} | {unit} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def baseline_note(baseline: str | Sequence[str] | None) -> str:
    if baseline is None:
        named = "the variant `torch` (or the only `torch…` one)"
    elif isinstance(baseline, str):
        named = f"`{baseline}`"
    else:
        named = " or ".join(f"`{b}`" for b in baseline)
    return (f"Baseline: {named}, shown as its value; other columns are value / baseline "
            "of the same case and metric (`=` marks a plain value where there is no baseline).")


# --- the machine --------------------------------------------------------------------------------

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def environment(device: str, mode: str = "") -> dict[str, str]:
    """What a reader needs to compare two reports: machine, versions, commit, date."""
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": f"{_cpu_name()} ({os.cpu_count()} logical cores, torch threads: {torch.get_num_threads()})",
        "device": device,
    }
    if mode:
        env["mode"] = mode
    if device == "cuda" and torch.cuda.is_available():
        i = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        env["gpu"] = (f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                      f"{torch.cuda.device_count()} visible)")
        env["cuda"] = torch.version.cuda or torch.version.hip or "?"
    else:
        env["gpu"] = "none used"
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    env.update({
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "gradaccel": _version("gradaccel"),
        "git": (commit[:12] + (" (uncommitted changes)" if dirty else "")) if commit else "unknown",
    })
    return env


# --- report.md ----------------------------------------------------------------------------------

def render_report(env: dict[str, str], tables: dict[str, str], plots: dict[str, list[str]],
                  failures: dict[str, str], command: str) -> str:
    """report.md: the environment and tables (between markers, for RESULTS.md), plots, failures."""
    out = ["# gradaccel bench", "", f"`{command}`", "", _KEEP_START, "",
           "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in env.items()]
    out.append("")
    for suite, table in tables.items():
        out += [f"## {suite}", "", table]
    out += [_KEEP_END, ""]
    if any(plots.values()):
        out += ["## Plots", ""]
        for suite, paths in plots.items():
            out += [f"![{suite}: {Path(p).stem}]({Path(p).name})" for p in paths]
        out.append("")
    if failures:
        out += ["## Failures", ""]
        for suite, text in failures.items():
            out += [f"### {suite}", "", "```", text.rstrip(), "```", ""]
    return "\n".join(out)


def remove_previous_plots(out: Path) -> list[Path]:
    """Delete the PNGs that the report.md already in ``out`` links to, and only those.

    Case names change between --tiny, --quick and --full runs, so plot files would otherwise
    pile up in bench/results/latest beside the current ones; files the previous run did not
    write are left alone.
    """
    old = out / "report.md"
    if not old.is_file():
        return []
    removed = []
    for name in re.findall(r"^!\[[^\]]*\]\(([^)/\\]+\.png)\)$", old.read_text(), re.M):
        path = out / name
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed


def results_section(report_md: str) -> tuple[str, str]:
    """(key, section) for RESULTS.md from a report.md: the key is the device (cpu or cuda)."""
    m = re.search(re.escape(_KEEP_START) + r"\n(.*?)" + re.escape(_KEEP_END), report_md, re.S)
    if m is None:
        raise ValueError("report.md has no results markers: was it written by `python -m bench`?")
    body = m.group(1).strip()
    env_table = body.split("\n## ", 1)[0]
    fields = dict(re.findall(r"^\| (\w+) \| (.*) \|$", env_table, re.M))
    key = fields.get("device", "cpu")
    where = fields.get("gpu") if key == "cuda" else fields.get("cpu")
    title = f"## {'GPU' if key == 'cuda' else 'CPU'}: {where}, {fields.get('date', '?')[:10]}"
    body = re.sub(r"^## ", "### ", body, flags=re.M)
    return key, f"<!-- bench:{key}:start -->\n{title}\n\n{body}\n<!-- bench:{key}:end -->"


def update_results_md(report_md: Path, target: Path) -> str:
    """Put report.md's tables into ``target``, replacing the section of the same device.

    A file without that section gets it appended. Returns the device key (cpu or cuda).
    """
    key, section = results_section(report_md.read_text())
    text = target.read_text() if target.exists() else "# Results\n"
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    target.write_text(text if text.endswith("\n") else text + "\n")
    return key


def partial_run(results_dir: Path, prog: str) -> bool:
    """Whether a CPU run in ``results_dir`` lacks a suite of ``python -m bench --all`` (said on
    stderr). Publishing (`make results`) replaces the device's whole section and the README's
    headline, so it takes whole runs only: `make bench` runs the default set, `make bench-all`
    every suite."""
    from bench.__main__ import SUITES

    rows = json.loads((results_dir / "results.json").read_text())
    if rows and rows[0]["device"] != "cpu":
        return False  # bench/gpu.sh publishes its own set of suites, through --results-md
    missing = [s for s in SUITES if s not in {r["suite"] for r in rows}]
    if missing:
        print(f"{prog}: {results_dir} lacks {', '.join(missing)}; publish a whole run (make bench-all), "
              "not the default set of make bench", file=sys.stderr)
    return bool(missing)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description="Copy a bench run's tables into RESULTS.md (or the README).")
    p.add_argument("dir", type=Path, help="a `python -m bench --out` directory")
    p.add_argument("--results-md", type=Path, default=REPO / "bench" / "RESULTS.md",
                   help="file whose <!-- bench:cpu|cuda:start/end --> section is replaced")
    a = p.parse_args(argv)
    if partial_run(a.dir, "python -m bench.report"):
        return 2
    key = update_results_md(a.dir / "report.md", a.results_md)
    print(f"{a.results_md}: {key} section updated from {a.dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
