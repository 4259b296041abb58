"""Count vector stack accesses inside the loops of kernel functions of a built binary.

A vector loaded from or stored to the stack inside a kernel's loop is a spill (or an array
the compiler chose to build there); on AMD Zen 5 such loops ran at speeds that moved with
the code and stack layout (benches/records/2026-12-07f-zen5-register-spills.md).

    python3 scripts/spill_scan.py target/release/examples/prefill int8_vnni512 gemm512
    python3 scripts/spill_scan.py --ymm BINARY int8_avx2   (256-bit vectors: the AVX2 kernels)

For every function whose symbol contains a pattern, prints each loop (a backward jump and
its target) that holds multiply-adds and stack vectors, then the total per pattern.
"""

from __future__ import annotations

import re
import subprocess
import sys

HEADER = re.compile(r"^([0-9a-f]+) <(.*)>:$")
JUMP = re.compile(r"j\w+\s+([0-9a-f]+) ")
MULTIPLY = ("vpdpbusd", "vfmadd", "vdpbf16ps", "vpmaddwd", "vpmaddubsw")


def functions(binary: str) -> dict[tuple[str, int], list[tuple[int, str]]]:
    """Every function of ``binary`` as (name, start) -> [(address, instruction)]."""
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", binary],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found: dict[tuple[str, int], list[tuple[int, str]]] = {}
    current = None
    for line in listing.splitlines():
        head = HEADER.match(line)
        if head:
            current = (head.group(2), int(head.group(1), 16))
            found[current] = []
            continue
        address, _, text = line.partition(":")
        if current is None or not text:
            continue
        try:
            found[current].append((int(address.strip(), 16), text.strip()))
        except ValueError:
            continue
    return found


def loops(start: int, body: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) address of each backward jump's range inside the function."""
    spans = []
    for address, text in body:
        jump = JUMP.match(text)
        if jump:
            target = int(jump.group(1), 16)
            if start <= target < address:
                spans.append((target, address))
    return spans


def main() -> int:
    args = sys.argv[1:]
    register = "zmm"
    if args and args[0] == "--ymm":
        register, args = "ymm", args[1:]
    if len(args) < 2:
        print(__doc__)
        return 2
    binary, patterns = args[0], args[1:]
    table = functions(binary)
    for pattern in patterns:
        total = 0
        for (name, start), body in table.items():
            if pattern not in name:
                continue
            for first, last in loops(start, body):
                inside = [t for a, t in body if first <= a <= last]
                stack = sum(1 for t in inside if register in t and "(%rsp)" in t)
                mults = sum(1 for t in inside if t.startswith(MULTIPLY))
                if stack and mults:
                    print(
                        f"{name[-40:]}: {len(inside)} instructions, {mults} multiply-adds, "
                        f"{stack} stack vectors"
                    )
                    total += stack
        print(f"{pattern}: {total} stack vectors in loops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
