"""scikit-learn's bundled handwritten digits, read without importing ``sklearn.datasets``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

__all__ = ["load_digits"]


def load_digits(*, flatten: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as ``(images, labels)``: float32 pixels in ``[0, 1]``, int64 labels.

    Reads ``sklearn/datasets/data/digits.csv.gz``, the file ``sklearn.datasets.load_digits``
    reads, directly: importing ``sklearn.datasets`` pulls in SciPy and costs seconds of CPU
    per rank, longer than a small training run. Nothing is downloaded. Falls back to
    ``sklearn.datasets.load_digits`` if the file is not where the package usually keeps it.

    Args:
        flatten (bool): images as ``(1797, 64)`` rows instead of ``(1797, 1, 8, 8)``.

    Raises:
        TypeError: ``flatten`` is not a bool.
        ModuleNotFoundError: scikit-learn is not installed.
    """
    if not isinstance(flatten, bool):
        raise TypeError(f"flatten must be a bool; got {flatten!r}")
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    roots = spec.submodule_search_locations if spec is not None else None
    path = Path(roots[0]) / "datasets" / "data" / "digits.csv.gz" if roots else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",")
        pixels, labels = table[:, :-1], table[:, -1]
    else:  # a layout we do not know: let scikit-learn find its own file
        from sklearn.datasets import load_digits as sklearn_digits

        pixels, labels = sklearn_digits(return_X_y=True)
    images = torch.tensor(pixels, dtype=torch.float32) / 16.0
    if not flatten:
        images = images.reshape(-1, 1, 8, 8)
    return images, torch.tensor(labels, dtype=torch.long)
