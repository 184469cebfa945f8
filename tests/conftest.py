import pytest

from gossamer.testing import close_pools


@pytest.fixture(scope="session", autouse=True)
def _reap_rank_pools():
    yield
    close_pools()
