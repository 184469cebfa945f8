"""The API pages under docs/api are what scripts/api_docs.py generates from the code now."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_api_pages_match_the_docstrings(tmp_path):
    for fresh in _generator().write(tmp_path):
        committed = ROOT / "docs" / "api" / fresh.name
        assert committed.is_file(), f"{committed} missing: run scripts/api_docs.py"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run .venv/bin/python scripts/api_docs.py"
        )


def test_every_public_name_has_a_docstring():
    api = _generator()
    pages = "".join(api.render(module) for module in api.MODULES)
    assert "(no docstring)" not in pages
