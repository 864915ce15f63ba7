"""Runs a test module's SCENARIOS on 2 gloo ranks (CPU) in one spawn, bounded in time.

Starting ranks (importing torch) costs more than the scenarios, so a test module puts all of its
multi-process scenarios in one dict, ``SCENARIOS = {name: fn(rank)}``, and one run executes them
in order on every rank; each rank writes what happened to a JSON file. A scenario named in
``POISONS`` leaves the process group unusable on purpose (a rank diverged): it runs last, without
the barrier after it, and ends the rank at once.
"""

import gc
import importlib
import json
import os
import socket
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank, port, out_dir, module_name):
    torch.set_num_threads(1)
    module = importlib.import_module(module_name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    poisons = getattr(module, "POISONS", ())
    results = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        for name, fn in module.SCENARIOS.items():
            try:
                fn(rank)
                results[name] = "ok"
            except BaseException:  # torch.distributed.checkpoint's CheckpointException is one
                results[name] = traceback.format_exc()
            if name in poisons:
                break
            dist.barrier()
    finally:
        with open(path, "w") as f:
            json.dump(results, f)
        if not any(name in results for name in poisons):
            gc.collect()  # a DDP reducer and its gloo work go before the group does
            dist.destroy_process_group()
    # Skip interpreter finalization: gloo's worker threads can still hold tensors then, and freeing
    # them needs the GIL of an interpreter being torn down, which aborts the rank (SIGABRT, seen in
    # CI after every scenario had passed). The results are already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenarios(module_name, out, timeout_s):
    """Runs ``module_name``'s SCENARIOS on WORLD ranks; returns each rank's {scenario: "ok" or traceback}."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    ranks = mp.spawn(_worker, args=(_free_port(), str(out), module_name), nprocs=WORLD, join=False)
    deadline = time.monotonic() + timeout_s
    files = [out / f"rank{r}.json" for r in range(WORLD)]
    try:
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:  # a hung collective must fail the test, not stall CI
                for p in ranks.processes:
                    p.kill()
                pytest.fail(f"the {WORLD} ranks did not finish within {timeout_s} s")
    except mp.ProcessExitedException as exc:
        # A rank writes its file only after the last scenario: with every file there, all
        # scenarios ran on all ranks, and what died was the process group's teardown.
        if not all(f.exists() for f in files):
            raise
        warnings.warn(f"a rank died after every scenario had finished (torch.distributed teardown): {exc}")
    missing = [r for r, f in enumerate(files) if not f.exists()]
    assert not missing, f"ranks {missing} did not get as far as running the scenarios"
    return [json.loads(f.read_text()) for f in files]


def torchrun(script, out_dir, timeout_s: int, **env) -> list[dict]:
    """Runs ``script`` (whose ranks write ``rank<r>.json`` into ``out_dir``) under ``torchrun
    --nproc_per_node 2``, as a user launches a Trainer; returns each rank's results. A run that
    outlasts ``timeout_s`` (a hung collective) fails the test rather than stalling CI."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
           str(script), str(out_dir)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish within {timeout_s} s:\n{(exc.stderr or '')[-3000:]}")
    files = [Path(out_dir) / f"rank{r}.json" for r in range(WORLD)]
    assert all(f.exists() for f in files), f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return [json.loads(f.read_text()) for f in files]
