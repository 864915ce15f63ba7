"""``gradaccel.fit.fit`` and ``python -m gradaccel.fit``: the public path of the memory fit
(gradaccel/memory/fit.py, which documents it)."""

import sys

from gradaccel.memory.fit import PRESETS, Fit, Planner, estimate, fit, main

__all__ = ["fit", "estimate", "Fit", "Planner", "PRESETS", "main"]

if __name__ == "__main__":
    sys.exit(main())
