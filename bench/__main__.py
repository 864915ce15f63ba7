"""`python -m bench`: run gradaccel side by side with stock PyTorch and write the results.

    python -m bench [--all | --suite accumulate,checkpoint,...] [--device cpu|cuda]
                    [--quick|--full|--tiny] [--out DIR] [--threads N] [--results-md PATH]

Without --suite or --all it runs the default set, DEFAULT_SUITES (accumulate, checkpoint, train:
the first table in minutes); --all runs every suite of SUITES (accumulate, checkpoint, train,
finetune, distributed, fit, frontier, chunked_loss, lengths, longctx: the published tables,
about half an hour on 2 CPU cores). `--suite offload` runs the raw store hooks too, on request only.
docs/benchmarks.md says what each suite compares and how long it takes.

Writes to DIR (default bench/results/latest): results.json and results.csv (one row per
measurement), report.md (environment and each suite's ratio tables), and each suite's PNG plots.
A suite that fails is reported (stderr, report.md) without losing the others' results; the exit
status is then 1.

What a suite is (the convention every ``bench/<suite>.py`` follows):

- ``run(device: str, quick: bool) -> list[dict]``: rows made by ``bench.common.row`` whose
  ``suite`` is the module's name and ``device`` the device it was given. Variants are named
  ``torch…`` (stock PyTorch) or ``gradaccel…`` (ours); each suite has at least one of each.
- ``plot(rows: list[dict], out_dir: str) -> list[str]``: writes PNGs into ``out_dir`` (which
  exists) from this suite's rows and returns their paths. The backend is Agg.
- While running, call ``bench.common.progress(case)`` (or ``progress(case, i, n)``, 1-based) as
  each case starts; the front end shows it. When ``bench.common.tiny()`` is true, run the
  smallest configuration that still exercises every variant and plot (the CLI's own test).
- Optional ``BASELINE = "torch-…"`` (or a list, first present wins): the variant each other
  variant of the same (case, metric) is divided by in the table. Undeclared, it is the variant
  named ``torch``, else the only ``torch…`` variant of that (case, metric).
- Leave process-wide settings to the front end: it sets torch's thread count (``--threads``,
  1 on CPU by default), seeds torch with 0 before each suite, and selects matplotlib's Agg.
- Optional ``TABLE_METRICS = ["time", …]``: only these metrics enter the table, in this order
  (per-step series such as loss curves stay in the files and plots only).

A name with a dot in ``--suite`` is imported as is (``mypkg.mysuite``); a plain name is
``bench.<name>``.
"""

import argparse
import builtins
import importlib
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

# Every suite (`--all`, `make bench-all`: what bench/RESULTS.md and the README publish); `--suite
# offload` runs the raw store hooks too. The default set (`make bench`) is the first table in minutes.
SUITES = ("accumulate", "checkpoint", "train", "finetune", "distributed", "fit", "frontier", "chunked_loss",
          "lengths", "longctx")
DEFAULT_SUITES = ("accumulate", "checkpoint", "train")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest"


class Progress:
    """One status line on stderr: suite k/N, case i/n with a bar, elapsed seconds.

    On a terminal the line is redrawn in place; into a file or pipe each update is its own line,
    so a log shows where a slow or stuck run was.
    """

    def __init__(self, n_suites: int, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.n_suites = n_suites
        self.k, self.suite, self.calls, self.t0 = 0, "", 0, time.perf_counter()

    def start(self, k: int, suite: str) -> None:
        self.k, self.suite, self.calls, self.t0 = k, suite, 0, time.perf_counter()
        self._show("starting")

    def case(self, case: str, i: int | None = None, n: int | None = None) -> None:
        self.calls += 1
        if i is not None and n:
            filled = round(10 * min(i, n) / n)
            where = f"[{'#' * filled}{'.' * (10 - filled)}] {i}/{n}"
        else:
            where = f"case {self.calls}"
        self._show(f"{where} {case}")

    def note(self, text: str) -> None:
        self._show(text)

    def end(self, text: str) -> None:
        self._show(text, final=True)

    def _show(self, text: str, final: bool = False) -> None:
        line = (f"[bench {self.k}/{self.n_suites}] {self.suite}: {text} "
                f"({time.perf_counter() - self.t0:.1f}s)")
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Suite conventions: see the docstring of bench/__main__.py.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--suite", default=",".join(DEFAULT_SUITES),
                       help=f"comma-separated suites to run (default: {','.join(DEFAULT_SUITES)}, minutes)")
    which.add_argument("--all", action="store_true",
                       help=f"every suite: {','.join(SUITES)} (about half an hour on 2 CPU cores)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when present, else cpu")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="small sizes, minutes on 2 CPU cores (the default on CPU)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="full sizes (the default on CUDA)")
    p.add_argument("--tiny", action="store_true",
                   help="for tests: implies --quick and makes bench.common.tiny() true, "
                        "so suites run in seconds; the numbers mean nothing")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads; 0: torch's own choice (default on CPU: "
                        "$GRADACCEL_BENCH_THREADS or 1, so ratios do not depend on how busy the "
                        "other cores are; on CUDA: torch's own choice)")
    p.add_argument("--results-md", type=Path, default=None, metavar="PATH",
                   help="also copy the tables into PATH (e.g. bench/RESULTS.md), replacing the "
                        "section of the same device")
    a = p.parse_args(argv)
    if a.all:
        a.suite = ",".join(SUITES)
    a.suites = [s.strip() for s in a.suite.split(",") if s.strip()]
    if not a.suites:
        p.error("--suite names no suite")
    if len(set(a.suites)) != len(a.suites):
        p.error(f"--suite names a suite twice: {a.suite}")
    return a


def load_suite(name: str):
    """The suite module: ``bench.<name>``, or ``name`` itself when it has a dot."""
    return importlib.import_module(name if "." in name else f"bench.{name}")


class NoSuite(Exception):
    """The module of a suite named on the command line does not exist."""


def run_suite(name: str, device: str, quick: bool, out: Path, show: Progress):
    """Run one suite and plot it; never raises.

    Returns (short name, rows, table, plot paths, failure text or None). Rows that a suite
    produced survive a failure of its ``plot``.
    """
    short = name.rsplit(".", 1)[-1]
    done = {"rows": [], "table": "", "plots": []}
    try:
        problems = _run_and_plot(name, short, device, quick, out, show, done)
    except NoSuite as e:
        problems = [str(e)]
    except Exception:  # noqa: BLE001 — one suite's failure must not cost the others' results
        problems = [traceback.format_exc()]
    if problems:
        failure = "\n".join(problems)
        show.end(f"FAILED ({len(done['rows'])} rows kept): {failure.strip().splitlines()[-1]}")
        print(f"\n--- {short} failed ---\n{failure}", file=sys.stderr, flush=True)
    else:
        failure = None
        show.end(f"done, {len(done['rows'])} rows, {len(done['plots'])} plots")
    return short, done["rows"], done["table"], done["plots"], failure


def _run_and_plot(name: str, short: str, device: str, quick: bool, out: Path, show: Progress,
                  done: dict) -> list[str]:
    """Fills ``done`` as it goes; returns the problems found in what the suite produced."""
    from bench import common, report
    import torch

    try:
        mod = load_suite(name)
    except ModuleNotFoundError as e:
        if e.name in (name, f"bench.{name}"):
            raise NoSuite(f"no suite '{name}': module {e.name} not found") from None
        raise
    torch.manual_seed(0)
    common.set_progress_hook(show.case)
    try:
        returned = mod.run(device, quick)
    finally:
        common.set_progress_hook(None)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    done["rows"], problems = report.check_rows(returned, short, device)
    baseline = getattr(mod, "BASELINE", None)
    done["table"] = report.baseline_note(baseline) + "\n\n" + report.suite_table(
        done["rows"], baseline, getattr(mod, "TABLE_METRICS", None))
    if done["rows"]:
        show.note("plotting")
        done["plots"] = [str(p) for p in (mod.plot(list(done["rows"]), str(out)) or [])]
        for p in done["plots"]:
            path = Path(p) if Path(p).exists() else out / p
            if not path.is_file() or path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
                problems.append(f"plot() returned {p}, which is not a PNG file")
    return problems


def _quiet_libraries() -> None:
    """Keeps the libraries' deprecation notices (transformers' renamed gradient_checkpointing,
    torch's pytree internals) and their thread-count advice off the screen, in this process and
    in the ranks it starts: they are about the libraries, not the results. gradaccel's own
    warnings still show."""
    quiet = ["ignore::FutureWarning", "ignore::DeprecationWarning",
             "ignore:OMP_NUM_THREADS/MKL_NUM_THREADS unset:UserWarning"]
    for rule in quiet:
        action, message, category = (rule.split(":") + ["", ""])[:3]
        warnings.filterwarnings(action, message=message, category=getattr(builtins, category or "Warning"))
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *quiet]))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    _quiet_libraries()
    from bench import common, report
    import torch

    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif a.device == "cuda" and not torch.cuda.is_available():
        print("python -m bench: --device cuda, but torch sees no CUDA device "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})", file=sys.stderr)
        return 2
    if a.device == "cuda" and a.suite == ",".join(SUITES) and torch.cuda.device_count() < 2:
        # Two NCCL ranks need two GPUs; by default the suite is left out rather than failed.
        print("python -m bench: one GPU: the distributed suite is skipped (it needs 2)", file=sys.stderr)
        a.suites = [s for s in a.suites if s != "distributed"]
    # The flag, not whatever the shell happens to hold, decides what suites see.
    os.environ[common.TINY_ENV] = "1" if a.tiny else "0"
    if a.tiny:
        a.quick = True
    elif a.quick is None:
        a.quick = a.device == "cpu"
    if a.threads is None and a.device == "cpu":
        a.threads = int(os.environ.get("GRADACCEL_BENCH_THREADS", "1"))
    if a.threads is not None and a.threads < 0:
        print(f"python -m bench: --threads must be >= 0 (0: torch's own choice), got {a.threads}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        a.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"python -m bench: cannot use --out {a.out}: {exc}", file=sys.stderr)
        return 2
    report.remove_previous_plots(a.out)

    mode = "tiny" if a.tiny else "quick" if a.quick else "full"
    print(f"python -m bench: {','.join(a.suites)} on {a.device}, {mode}, into {a.out}",
          file=sys.stderr, flush=True)
    show = Progress(len(a.suites))
    t0 = time.perf_counter()
    all_rows, tables, plots, failures = [], {}, {}, {}
    for k, name in enumerate(a.suites, 1):
        show.start(k, name.rsplit(".", 1)[-1])
        short, rows, table, suite_plots, failure = run_suite(name, a.device, a.quick, a.out, show)
        all_rows += rows
        if table:
            tables[short] = table
        plots[short] = suite_plots
        if failure:
            failures[short] = failure

    report.write_json(all_rows, a.out / "results.json")
    report.write_csv(all_rows, a.out / "results.csv")
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    env = report.environment(a.device, mode)
    env["duration"] = f"{time.perf_counter() - t0:.0f} s"
    md = report.render_report(env, tables, plots, failures, command.strip())
    (a.out / "report.md").write_text(md)
    if a.results_md is not None and not failures:
        report.update_results_md(a.out / "report.md", a.results_md)
    elif a.results_md is not None:
        print(f"{a.results_md} left unchanged: a suite failed", file=sys.stderr)

    for short, table in tables.items():
        print(f"\n## {short}\n\n{table}")
    print(f"{len(all_rows)} rows, {sum(map(len, plots.values()))} plots in {env['duration']}: {a.out}")
    if failures:
        print(f"FAILED suites: {', '.join(failures)} (details above and in {a.out / 'report.md'})",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
