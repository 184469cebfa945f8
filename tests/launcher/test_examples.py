"""The examples run as documented: under the launcher and with plain python."""

import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _errors(stdout):
    return [float(v) for v in re.findall(r"consensus error (\S+)", stdout)]


@pytest.mark.parametrize(
    ("np_", "topology", "rate"), [(3, "exponential", 1 / 3), (4, "ring", 1 / 3)]
)
def test_consensus_demo_converges_at_the_mixing_rate(np_, topology, rate):
    cmd = [
        sys.executable,
        "-m",
        "gossamer.launcher",
        "run",
        "-np",
        str(np_),
        str(EXAMPLES / "average_consensus.py"),
        "--topology",
        topology,
        "--max-iters",
        "5",
        "--data-size",
        "1000",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    errors = _errors(done.stdout)
    assert len(errors) == 6
    # For a symmetric W the error contracts by at most |lambda_2|^2 per step (the slack
    # covers the 4 printed digits).
    # (Once at rounding level, about 1e-30, the error just stays there.)
    for before, after in itertools.pairwise(errors):
        assert after <= max(before * rate**2 * (1 + 2e-3), 1e-28)
    assert errors[-1] < errors[0] * 1e-4


def test_consensus_demo_runs_as_a_world_of_one():
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "average_consensus.py"),
            "--max-iters",
            "2",
            "--data-size",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert all(math.isclose(e, 0.0, abs_tol=1e-30) for e in _errors(done.stdout))
