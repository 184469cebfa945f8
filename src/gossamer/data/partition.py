"""The `Partition` value type (which samples each rank owns) and its per-rank sampler."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, Subset

from gossamer.data._checks import check_int

__all__ = ["PartSampler", "Partition"]


def _as_indices(part: Any, name: str, *, sort: bool) -> np.ndarray:
    """Return ``part`` as a read-only int64 copy (sorted if asked), or raise naming ``name``."""
    if isinstance(part, torch.Tensor):
        part = part.detach().cpu().numpy()
    try:
        arr = np.asarray(part)
    except (TypeError, ValueError) as exc:  # ragged nesting: numpy's message names nothing
        raise TypeError(f"{name} must be a 1-D sequence of indices; got {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of indices; got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty: every rank needs samples")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer indices; got dtype {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"{name} must hold indices >= 0; got {arr.min()}")
    arr = np.sort(arr.astype(np.int64)) if sort else arr.astype(np.int64, copy=True)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False, repr=False)
class Partition:
    """Disjoint index lists, one per rank (part), into one labelled dataset.

    Part ``r`` holds the dataset indices that rank ``r`` trains on. Each part is stored as a
    read-only int64 array **sorted ascending** (the order carries no randomness; the
    per-epoch shuffling is the sampler's job), so a ``Partition`` is a hashable value:
    two partitions are equal when their parts are. ``name`` is only a label.

    The partitioners (:func:`gossamer.data.iid`, :func:`~gossamer.data.dirichlet`,
    :func:`~gossamer.data.shards`) use every index of the dataset exactly once. A partition
    built by hand may leave indices out, but no index may appear twice.

    Args:
        parts: One sequence (list, array or tensor) of non-negative int indices per part.
        name: Human-readable label, e.g. ``"dirichlet(num_parts=8, alpha=0.1, seed=0)"``.

    Raises:
        TypeError: ``parts`` is not a sequence of integer sequences, or ``name`` not a str.
        ValueError: ``parts`` is empty, a part is empty, not 1-D or has a negative index,
            or an index appears more than once.

    Example:
        >>> p = Partition([[4, 0], [1, 3, 2]])
        >>> p.part(0), p.sizes
        (array([0, 4]), array([2, 3]))
    """

    parts: tuple[np.ndarray, ...]
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str; got {self.name!r}")
        parts = self.parts
        if isinstance(parts, str | bytes | np.ndarray | torch.Tensor) or not isinstance(
            parts, Sequence
        ):
            raise TypeError(
                f"parts must be a sequence of index sequences; got {type(parts).__name__}"
            )
        if len(parts) == 0:
            raise ValueError("parts must hold at least one part; got 0")
        arrays = tuple(_as_indices(part, f"parts[{r}]", sort=True) for r, part in enumerate(parts))
        everything = np.concatenate(arrays)
        values, counts = np.unique(everything, return_counts=True)
        if np.any(counts > 1):
            index = int(values[np.argmax(counts > 1)])
            owners = [r for r, arr in enumerate(arrays) if np.isin(index, arr)]
            raise ValueError(f"index {index} appears more than once (parts {owners})")
        # The dataclass is frozen, so the validated copy has to bypass __setattr__.
        object.__setattr__(self, "parts", arrays)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return len(self.parts) == len(other.parts) and all(
            np.array_equal(a, b) for a, b in zip(self.parts, other.parts, strict=True)
        )

    def __hash__(self) -> int:
        return hash(tuple(part.tobytes() for part in self.parts))

    def __repr__(self) -> str:
        return (
            f"Partition(name={self.name!r}, num_parts={self.num_parts}, "
            f"num_samples={self.num_samples})"
        )

    @property
    def num_parts(self) -> int:
        """Number of parts, i.e. of ranks the data is split over."""
        return len(self.parts)

    @property
    def sizes(self) -> np.ndarray:
        """Number of indices in each part, shape ``(num_parts,)``."""
        return np.array([len(part) for part in self.parts], dtype=np.int64)

    @property
    def num_samples(self) -> int:
        """Total number of indices over all parts."""
        return int(self.sizes.sum())

    def _rank(self, rank: object) -> int:
        rank = check_int(rank, "rank")
        if not 0 <= rank < self.num_parts:
            raise ValueError(f"rank must be in [0, {self.num_parts}); got {rank}")
        return rank

    def part(self, rank: int) -> np.ndarray:
        """Return the sorted, read-only int64 indices of ``rank``'s part.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``[0, num_parts)``.
        """
        return self.parts[self._rank(rank)]

    def sampler(
        self,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_samples: int | None = None,
    ) -> PartSampler:
        """Return a sampler over ``rank``'s indices, for ``DataLoader(sampler=...)``.

        Like ``torch.utils.data.DistributedSampler``, call ``sampler.set_epoch(epoch)``
        before each epoch to draw a new order.

        Args:
            rank: The part to sample, in ``[0, num_parts)``.
            shuffle: Draw a new permutation every epoch; if ``False`` iterate in ascending
                index order.
            seed: Base seed of the permutations (the same on every rank is fine: the rank
                is mixed in).
            num_samples: Indices per epoch; ``None`` means the part's size. Synchronous
                optimizers need every rank to take the same number of steps, and skewed
                partitions have unequal parts: pass ``max(partition.sizes)`` to make the
                smaller parts wrap around (as ``DistributedSampler`` pads), or
                ``min(partition.sizes)`` to truncate.

        Raises:
            TypeError: ``rank``, ``seed`` or ``num_samples`` is not an int.
            ValueError: ``rank`` is out of range, ``seed < 0`` or ``num_samples < 1``.
        """
        rank = self._rank(rank)
        return PartSampler(
            self.parts[rank], shuffle=shuffle, seed=seed, rank=rank, num_samples=num_samples
        )

    def subset(self, dataset: Dataset, rank: int) -> Subset:
        """Return ``torch.utils.data.Subset(dataset, part(rank))``.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is out of range, or the part holds an index past
                ``len(dataset)`` (when the dataset has a length).
        """
        indices = self.part(rank)
        if hasattr(dataset, "__len__") and indices[-1] >= len(dataset):
            raise ValueError(
                f"part {rank} holds index {indices[-1]} but dataset has {len(dataset)} samples"
            )
        return Subset(dataset, indices.tolist())


class PartSampler(Sampler[int]):
    """Iterate over one part's indices, reshuffled per epoch like ``DistributedSampler``.

    The order of epoch ``e`` is a permutation drawn from
    ``numpy.random.default_rng([seed, rank, e])``: deterministic, the same in every
    process, and independent across ranks and epochs. With ``num_samples`` larger than
    the part, the permutation is repeated cyclically; smaller, it is truncated.

    Args:
        indices: The dataset indices to sample (one part of a :class:`Partition`).
        shuffle: Permute every epoch; if ``False`` yield ``indices`` in their order.
        seed: Base seed, ``>= 0``.
        rank: Mixed into the seed so that ranks draw independent orders, ``>= 0``.
        num_samples: Indices per epoch, ``>= 1``; ``None`` means ``len(indices)``.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``indices`` is empty, or a number is out of range.

    Example:
        >>> sampler = PartSampler([10, 11, 12], seed=0)
        >>> sampler.set_epoch(1)
        >>> sorted(sampler)
        [10, 11, 12]
    """

    def __init__(
        self,
        indices: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        num_samples: int | None = None,
    ) -> None:
        self.indices = _as_indices(indices, "indices", sort=False)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool; got {shuffle!r}")
        self.shuffle = shuffle
        self.seed = check_int(seed, "seed", minimum=0)
        self.rank = check_int(rank, "rank", minimum=0)
        self.num_samples = (
            len(self.indices)
            if num_samples is None
            else check_int(num_samples, "num_samples", minimum=1)
        )
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (``>= 0``) on the next iteration."""
        self.epoch = check_int(epoch, "epoch", minimum=0)

    def __iter__(self) -> Iterator[int]:
        order = self.indices
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.rank, self.epoch])
            order = order[rng.permutation(len(order))]
        return iter(np.resize(order, self.num_samples).tolist())

    def __len__(self) -> int:
        return self.num_samples
