"""The layers of docs/architecture.md, enforced: who may import whom, and no private names.

Every module of ``src/gossamer`` is parsed (not imported). A module belongs to the package
named by its first component under ``gossamer`` (``gossamer.ops.neighbor`` -> ``ops``;
single-module layers such as ``context`` are their own package). It may import only the
packages listed for it in :data:`ALLOWED`, and never a private name (``_x``) or a private
module of another package. A private module may be imported only within its own package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "gossamer"

_LEAVES = {"errors", "env", "topology", "compression", "data", "combine", "fusion", "models"}
_CORE = {"context", "transport", "ops", "windows", "communicators", "optim"}
# package -> the gossamer packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "env": {"errors"},
    "topology": {"errors"},
    "compression": {"errors"},
    "data": set(),
    "combine": set(),
    "fusion": set(),
    "models": set(),
    "profiling": {"env", "errors"},
    "context": {"env", "errors", "profiling"},
    "transport": {"context", "env", "errors", "profiling", "topology"},
    "ops": {"transport", "context", "errors", "profiling", "topology", "combine"},
    "windows": {"ops", "transport", "context", "errors", "topology", "combine"}
    | {"compression", "profiling"},
    "communicators": {
        "windows",
        "ops",
        "transport",
        "context",
        "errors",
        "topology",
        "fusion",
        "compression",
        "combine",
        "profiling",
    },
    "optim": {"communicators", "windows", "ops", "transport", "context", "errors"}
    | {"topology", "fusion", "profiling", "compression"},
    "checkpoint": {"optim", "ops", "transport", "context", "errors", "env"},
    "launcher": {"env", "errors"},
    "testing": {"context", "env", "errors"},
    "bluefog": _LEAVES | _CORE | {"profiling", "checkpoint", "root"},
    "bagua": _LEAVES | _CORE | {"profiling", "checkpoint", "root"},
    "root": _LEAVES | _CORE | {"profiling", "checkpoint", "launcher", "testing"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    if parts == ["gossamer"]:
        return "root"
    return parts[1]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every gossamer import."""
    tree = ast.parse(path.read_text())
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("gossamer")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package_parts[: len(package_parts) - node.level + 1], base])
            if base == "gossamer" or base.startswith("gossamer."):
                out.append((base.strip("."), [a.name for a in node.names], node.lineno))
    return out


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    mine = _package(module)
    assert mine in ALLOWED, f"{module}: package {mine!r} has no entry in ALLOWED"
    problems = []
    for target, names, line in _imports(module, MODULES[module]):
        theirs = _package(target)
        # `from gossamer import ops` names a package, not the root's API.
        if theirs == "root" and names and all(f"gossamer.{n}" in MODULES for n in names):
            theirs_list = [_package(f"gossamer.{n}") for n in names]
        else:
            theirs_list = [theirs]
        for other in theirs_list:
            if other != mine and other not in ALLOWED[mine]:
                problems.append(f"line {line}: {mine} may not import {other} ({target})")
        private_module = any(p.startswith("_") for p in target.split(".")[1:])
        if private_module and theirs != mine:
            problems.append(f"line {line}: private module {target} of another package")
        if target != module:
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"line {line}: private names {private} from {target}")
    assert not problems, f"{module}:\n" + "\n".join(problems)


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES}
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))
