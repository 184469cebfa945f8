"""How skewed a partition is: per-part label histograms and total-variation distances."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gossamer.data._checks import as_labels, check_int
from gossamer.data.partition import Partition

__all__ = ["Skew", "label_histograms", "skew"]


class Skew(NamedTuple):
    """Result of :func:`skew`: per-part distances and their mean."""

    per_part: np.ndarray
    """Total-variation distance of each part from the global distribution, ``(num_parts,)``."""
    mean: float
    """``per_part.mean()``: 0 for a perfectly IID split, towards 1 for disjoint classes."""


def label_histograms(
    partition: Partition, labels: Sequence[int] | Any, num_classes: int | None = None
) -> np.ndarray:
    """Count the labels of every part.

    ``H[r, c]`` is the number of indices ``i`` in part ``r`` with ``labels[i] == c``. This
    matrix is what :func:`gossamer.topology.d_cliques` takes.

    Args:
        partition: The partition.
        labels: The dataset's labels (class indices ``>= 0``), indexed by the partition.
        num_classes: Number of columns; ``None`` means ``max(labels) + 1``.

    Returns:
        An int64 array of shape ``(partition.num_parts, num_classes)``.

    Raises:
        TypeError: ``partition`` is not a ``Partition``, ``labels`` is not integer, or
            ``num_classes`` is not an int.
        ValueError: An index of the partition is ``>= len(labels)``, or a label is
            ``>= num_classes``.

    Example:
        >>> label_histograms(Partition([[0, 1], [2]]), [0, 1, 1])
        array([[1, 1],
               [0, 1]])
    """
    if not isinstance(partition, Partition):
        raise TypeError(f"partition must be a Partition; got {type(partition).__name__}")
    y = as_labels(labels)
    if num_classes is None:
        num_classes = int(y.max()) + 1
    num_classes = check_int(num_classes, "num_classes", minimum=1)
    if y.max() >= num_classes:
        raise ValueError(f"labels must be < num_classes={num_classes}; got {y.max()}")
    largest = max(int(part[-1]) for part in partition.parts)
    if largest >= len(y):
        raise ValueError(f"partition holds index {largest} but labels has only {len(y)} entries")
    return np.stack([np.bincount(y[part], minlength=num_classes) for part in partition.parts])


def _tv_from_histograms(histograms: np.ndarray) -> np.ndarray:
    """Return each row's total-variation distance from the distribution of the row sum."""
    counts = histograms.astype(np.float64)
    total = counts.sum(axis=0)
    reference = total / total.sum()
    rows = counts / counts.sum(axis=1, keepdims=True)
    return 0.5 * np.abs(rows - reference).sum(axis=1)


def skew(partition: Partition, labels: Sequence[int] | Any) -> Skew:
    """Measure label skew as each part's total-variation distance from the global mix.

    With ``p_r`` the label distribution of part ``r`` and ``p`` the label distribution of
    all indices the partition holds (the whole dataset for the built-in partitioners),

    ``TV_r = 1/2 * sum_c |p_r(c) - p(c)|``, in ``[0, 1]``.

    ``TV_r = 0`` means part ``r`` looks like the whole data set; with ``C`` balanced
    classes, a part holding ``k`` of them equally has ``TV_r = 1 - k / C``.

    Args:
        partition: The partition.
        labels: The dataset's labels (class indices ``>= 0``).

    Returns:
        ``Skew(per_part, mean)``: the vector of ``TV_r`` and its mean.

    Raises:
        TypeError: ``partition`` is not a ``Partition`` or ``labels`` is not integer.
        ValueError: An index of the partition is ``>= len(labels)``.

    Example:
        >>> skew(Partition([[0, 1], [2, 3]]), [0, 0, 1, 1]).mean
        0.5
    """
    per_part = _tv_from_histograms(label_histograms(partition, labels))
    return Skew(per_part, float(per_part.mean()))
