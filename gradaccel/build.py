"""``python -m gradaccel.build``: build gradaccel's C++ extension now, rather than on first use.

For a Docker image (run it in the image, with the torch the image will train with), or before
several ranks start. It builds into the same cache that first use reads
(gradaccel/ops/extension.py) and prints the folder; a build already there is reused.
"""

import argparse
import sys

from gradaccel.ops import extension


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradaccel.build", description=__doc__.splitlines()[0])
    parser.add_argument("--where", action="store_true", help="print the build folder and whether it is built; build nothing")
    args = parser.parse_args(argv)
    if args.where:
        print(f"{extension.build_dir()} ({'built' if extension.is_built() else 'not built'})")
        return 0
    extension.load()
    print(extension.build_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
