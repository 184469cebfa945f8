"""gossamer.env: every variable's default, and a clear error for each bad value."""

import pytest

from gossamer import env


def test_defaults():
    got = env.settings({})
    assert (got.backend, got.timeout, got.dead_after, got.log_level) == (
        "gloo",
        300.0,
        3.0,
        "WARNING",
    )
    assert got.nodes_per_machine is None and got.timeline is None


def test_values_are_read():
    got = env.settings(
        {"GOSSAMER_TIMEOUT": "12.5", "GOSSAMER_DEAD_AFTER": "30", "GOSSAMER_NODES_PER_MACHINE": "2"}
    )
    assert (got.timeout, got.dead_after, got.nodes_per_machine) == (12.5, 30.0, 2)


@pytest.mark.parametrize("name", ["GOSSAMER_TIMEOUT", "GOSSAMER_DEAD_AFTER"])
@pytest.mark.parametrize("raw", ["0", "-1", "abc", "inf", "nan", ""])
def test_bad_seconds_name_the_variable_and_value(name, raw):
    with pytest.raises(
        ValueError, match=f"{name} must be a positive number of seconds; got {raw!r}"
    ):
        env.settings({name: raw})


def _dead_after():
    from gossamer.transport import failures, liveness

    live = liveness.get_liveness()
    return live.dead_after, str(failures.lost_error("op", [1]))


def test_liveness_and_its_error_follow_gossamer_dead_after():
    from gossamer.testing import run_distributed

    for dead_after, text in run_distributed(_dead_after, 2, env={"GOSSAMER_DEAD_AFTER": "7.5"}):
        assert dead_after == 7.5
        assert "rank 1 was lost (its process died or left the job, or its heartbeat" in text
        assert "GOSSAMER_DEAD_AFTER=7.5 s" in text
