"""Fail if kt-core's modules import each other in a circle.

Checked: the top-level modules of `crates/kt-core/src`, and the submodules of each folder.
Only `crate::` and `super::` paths in code count; comments and `#[cfg(test)] mod tests` are
ignored, since tests may reach anywhere.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "crates" / "kt-core" / "src"


def module_path(file: pathlib.Path) -> list[str]:
    parts = list(file.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return parts


def code_of(file: pathlib.Path) -> str:
    lines = [s for s in file.read_text().splitlines() if not s.strip().startswith("//")]
    return re.split(r"#\[cfg\(test\)\]\s*mod tests\s*\{", "\n".join(lines))[0]


def import_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for file in ROOT.rglob("*.rs"):
        parts = module_path(file)
        if not parts or "tests" in parts or parts[-1] == "testutil":
            continue
        top, code = parts[0], code_of(file)
        for m in re.finditer(r"crate::([a-z_0-9]+)", code):
            if m.group(1) != top:
                edges.setdefault(top, set()).add(m.group(1))
        if len(parts) >= 2:
            here = f"{top}/{parts[1]}"
            for m in re.finditer(rf"(?:super|crate::{top})::([a-z_0-9]+)", code):
                if m.group(1) != parts[1]:
                    edges.setdefault(here, set()).add(f"{top}/{m.group(1)}")
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    found = circles(import_graph())
    if found:
        for c in found:
            print("import circle in kt-core:", " <-> ".join(c))
        return 1
    print("kt-core modules: no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
