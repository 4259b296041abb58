"""``python -m kt_kernel`` (also the ``kt`` command): ``info``, ``bench`` and ``quant``."""

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
    quant = sub.add_parser(
        "quant", help="convert a Hugging Face MoE checkpoint to AMXINT8/AMXINT4 weights"
    )
    from .convert import add_arguments as add_quant_arguments

    add_quant_arguments(quant, kt_quant=True)
    args = parser.parse_args(argv)
    if args.command == "info":
        import kt_kernel

        print(json.dumps({"cpu": kt_kernel.cpu_info(), "build": kt_kernel.build_info()}, indent=2))
        return 0
    if args.command == "quant":
        from .convert import run as convert

        return convert(args)
    from .bench import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
