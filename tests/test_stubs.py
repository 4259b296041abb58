"""The type stubs of the native module (``_kt_core.pyi``) name exactly what it exports, with
the parameter names and defaults the runtime reports, and ship with ``py.typed``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kt_kernel
from kt_kernel import _kt_core

PACKAGE = Path(kt_kernel.__file__).parent


def _stub() -> ast.Module:
    return ast.parse((PACKAGE / "_kt_core.pyi").read_text())


def _params(fn: ast.FunctionDef) -> list[tuple[str, str | None]]:
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + fn.args.defaults
    return [
        (a.arg, None if d is None else ast.unparse(d))
        for a, d in zip(args, defaults, strict=True)
        if a.arg != "self"
    ]


def _runtime(obj) -> list[tuple[str, str | None]]:
    sig = inspect.signature(obj)
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "$self", "cls"):
            continue
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append((p.name, default))
    return out


def _same_default(stub: str | None, runtime: str | None) -> bool:
    if stub is None or runtime is None:
        return stub == runtime
    if runtime == "Ellipsis":  # PyO3 shows an expression default (1 << 30) as "..."
        return True
    return eval(stub) == eval(runtime)  # noqa: S307 (literals from our own stub and signature)


def _check(stub_fn: ast.FunctionDef, obj, where: str) -> None:
    stub, runtime = _params(stub_fn), _runtime(obj)
    assert [n for n, _ in stub] == [n for n, _ in runtime], (where, stub, runtime)
    for (name, a), (_, b) in zip(stub, runtime, strict=True):
        assert _same_default(a, b), (where, name, a, b)


def test_the_stub_matches_the_native_module():
    stub = _stub()
    names = set()
    for node in stub.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
            _check(node, getattr(_kt_core, node.name), node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            cls = getattr(_kt_core, node.name)
            members = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            runtime = {m for m in dir(cls) if not m.startswith("_")}
            assert members - {"__init__"} == runtime, (node.name, members ^ runtime)
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                is_property = any(ast.unparse(d) == "property" for d in fn.decorator_list)
                if fn.name == "__init__":
                    _check(fn, cls, f"{node.name}()")
                elif not is_property:
                    _check(fn, getattr(cls, fn.name), f"{node.name}.{fn.name}")
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    exported = {n for n in dir(_kt_core) if not n.startswith("_")} | {"__version__"}
    assert names == exported, names ^ exported


def test_the_package_is_marked_typed():
    assert (PACKAGE / "py.typed").exists()
