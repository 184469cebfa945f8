"""Fixtures and import path for every test folder.

Importing this conftest puts tests/ on sys.path (pytest's default "prepend" import mode), so
the modules that several test folders share, oracle.py and problems.py, import by bare name,
here and in the rank processes, which start with this process's sys.path.
"""

import pytest
import torch

from gossamer.profiling import timeline
from gossamer.testing import close_pools


@pytest.fixture(scope="session", autouse=True)
def _reap_rank_pools():
    yield
    close_pools()


@pytest.fixture
def timeline_off():
    """Stop this process's timeline after the test, whether or not the test stopped it."""
    yield
    if timeline.timeline_enabled():
        timeline.stop_timeline()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skip them where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
