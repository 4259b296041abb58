"""``python -m kt_kernel`` (also the ``kt`` command): ``info`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kt", description="kt_kernel command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="CPU features, chosen kernels, topology, build")
    bench = sub.add_parser("bench", help="benchmark MoE layers on synthetic weights")
    from .bench import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "info":
        import kt_kernel

        print(json.dumps({"cpu": kt_kernel.cpu_info(), "build": kt_kernel.build_info()}, indent=2))
        return 0
    from .bench import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
