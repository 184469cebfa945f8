"""examples/bagua_digits.py runs as documented: under the launcher and with plain python."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bagua_digits.py"


def _accuracies(stdout):
    line = re.search(r"test accuracy per rank ([0-9., ]+);", stdout)
    assert line, stdout
    return [float(a) for a in line.group(1).split(",")]


def test_example_under_the_launcher():
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", "-np", "2", str(EXAMPLE)]
    cmd += ["--algorithm", "bytegrad", "--epochs", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    accuracies = _accuracies(done.stdout)
    assert len(accuracies) == 2 and min(accuracies) > 0.5


def test_example_as_a_world_of_one():
    cmd = [sys.executable, str(EXAMPLE), "--algorithm", "qadam", "--epochs", "1"]
    cmd += ["--qadam-warmup-steps", "10"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(_accuracies(done.stdout)) == 1
