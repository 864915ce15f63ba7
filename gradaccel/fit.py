"""``gradaccel.fit.fit``, ``gradaccel.fit.max_seq`` and ``python -m gradaccel.fit``: the public path
of the memory fit (gradaccel/memory/fit.py, longest.py and fit_cli.py, which document it)."""

import sys

from gradaccel.memory.fit import PRESETS, Fit, Planner, estimate, fit
from gradaccel.memory.fit_cli import main
from gradaccel.memory.longest import max_seq

__all__ = ["fit", "estimate", "max_seq", "Fit", "Planner", "PRESETS", "main"]

if __name__ == "__main__":
    sys.exit(main())
