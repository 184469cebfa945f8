"""Write docs/api/<module>.md from the docstrings of each public module's ``__all__``.

    .venv/bin/python scripts/api_docs.py [--out docs/api]

tests/unit/test_api_docs.py regenerates the pages and fails when the committed ones differ,
so the API pages cannot drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from pathlib import Path

MODULES = {
    "gossamer": "runtime context, collectives and neighbour operations, windows, errors",
    "gossamer.topology": "topology values, generators, weights, dynamic schedules",
    "gossamer.windows": "one-sided windows",
    "gossamer.communicators": "communication patterns as strategy objects",
    "gossamer.data": "partitioners for skewed data, skew measures, BatchNorm swap",
    "gossamer.optim": "decentralized optimizers and training helpers",
    "gossamer.checkpoint": "checkpoints for exact resume: one file per rank and a manifest",
    "gossamer.fusion": "flat buckets for tensor fusion",
    "gossamer.compression": "compressors, error feedback, registry (pure tensor transforms)",
    "gossamer.profiling": "timeline (Chrome trace)",
    "gossamer.testing": "the distributed test harness",
    "gossamer.models": "small models for examples and benchmarks",
    "gossamer.bluefog": "the BlueFog facade (`import gossamer.bluefog as bf`)",
    "gossamer.bagua": "the Bagua facade (`import gossamer.bagua as bagua`)",
}


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # builtins and some C-level callables
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # default values' addresses change per run


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(no docstring)"


def _members(cls) -> list[tuple[str, object]]:
    """Public methods and properties defined by ``cls`` itself, in source order."""
    return [
        (name, value)
        for name, value in vars(cls).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or isinstance(value, property | classmethod | staticmethod))
    ]


def _entry(module: str, name: str, obj) -> list[str]:
    if inspect.isclass(obj):
        lines = [f"### class `{name}{_signature(obj)}`", "", _doc(obj), ""]
        for member, value in _members(obj):
            if isinstance(value, property):
                lines += [f"- **`{member}`** (property): {_doc(value).splitlines()[0]}"]
                continue
            func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
            first = _doc(func).splitlines()[0]
            lines += [f"- **`{member}{_signature(func)}`**: {first}"]
        return [*lines, ""]
    if inspect.ismodule(obj):  # its repr holds a path, which differs per checkout
        return [f"### module `{obj.__name__}`", "", _doc(obj).splitlines()[0], ""]
    if callable(obj):
        return [f"### `{name}{_signature(obj)}`", "", _doc(obj), ""]
    return [f"### `{name}`", "", f"`{obj!r}`", ""]


def render(module: str) -> str:
    """The markdown page of ``module``."""
    mod = importlib.import_module(module)
    lines = [f"# `{module}`: {MODULES[module]}", "", _doc(mod), ""]
    for name in sorted(mod.__all__, key=str.lower):
        if name.startswith("__"):
            continue
        lines += _entry(module, name, getattr(mod, name))
    return "\n".join(lines).rstrip() + "\n"


def write(out: Path) -> list[Path]:
    """Write every page (and an index) under ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    index = ["# API reference", "", "Generated from the docstrings by `scripts/api_docs.py`.", ""]
    for module, summary in MODULES.items():
        path = out / f"{module}.md"
        path.write_text(render(module))
        paths.append(path)
        index.append(f"- [`{module}`]({path.name}): {summary}")
    (out / "README.md").write_text("\n".join(index) + "\n")
    return [*paths, out / "README.md"]


def main() -> None:
    """Write the pages where ``--out`` says."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "docs" / "api")
    for path in write(parser.parse_args().out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
