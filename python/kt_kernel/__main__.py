"""``python -m kt_kernel`` (also the ``kt`` command): ``info``, ``version``, ``doctor``,
``bench`` and ``quant``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kt", description="kt_kernel command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="CPU features, chosen kernels, topology, build")
    version = sub.add_parser("version", help="package, core crate, build profile and git revision")
    version.add_argument("--json", action="store_true", help="one JSON object")
    doctor = sub.add_parser(
        "doctor", help="CPU, kernels, NUMA, memory, huge pages, CUDA, torch, and what to fix"
    )
    from .doctor import add_arguments as add_doctor_arguments

    add_doctor_arguments(doctor)
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
    if args.command == "version":
        return print_version(args.json)
    if args.command == "doctor":
        from .doctor import run as doctor

        return doctor(args)
    if args.command == "quant":
        from .convert import run as convert

        return convert(args)
    from .bench import run

    return run(args)


def version_facts() -> dict:
    """What ``kt version`` prints: the Python package's version (as installed), the compiled
    extension's and the core crate's, the build profile and the git revision built from."""
    from importlib import metadata

    import kt_kernel

    build = kt_kernel.build_info()
    try:
        installed = metadata.version("kt-kernel")
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        installed = kt_kernel.__version__
    return {
        "package": installed,
        "extension": kt_kernel.__version__,
        "core": build["core_version"],
        "profile": build["profile"],
        "git_revision": build["git_revision"],
    }


def print_version(as_json: bool) -> int:
    facts = version_facts()
    if as_json:
        print(json.dumps(facts))
    else:
        print(f"kt_kernel {facts['package']} (extension {facts['extension']})")
        print(f"kt-core {facts['core']}, {facts['profile']} build, git {facts['git_revision']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
