"""Split a labelled dataset over ranks: IID, Dirichlet label skew, and k classes per rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gossamer.data._checks import as_labels, check_int, check_positive_float, check_seed
from gossamer.data.partition import Partition

__all__ = ["dirichlet", "iid", "shards"]

# Enough for any min_size that a skew level can meet; past it the request is hopeless.
_DIRICHLET_TRIES = 1000


def _check_num_parts(num_parts: object, num_samples: int) -> int:
    num_parts = check_int(num_parts, "num_parts", minimum=1)
    if num_parts > num_samples:
        raise ValueError(
            f"num_parts must be <= the number of samples ({num_samples}); got {num_parts}"
        )
    return num_parts


def iid(labels: Sequence[int] | Any, num_parts: int, seed: int = 0) -> Partition:
    """Split the dataset uniformly at random into ``num_parts`` near-equal parts.

    The indices ``0 .. n-1`` are permuted with ``numpy.random.default_rng(seed)`` and cut
    into ``num_parts`` consecutive runs whose sizes differ by at most one
    (``numpy.array_split``): no index is dropped. Each part's label distribution matches
    the global one up to sampling noise; this is the baseline without skew.

    Args:
        labels: The dataset's labels: a sequence, array or tensor of class indices
            ``>= 0``. Only its length matters here; it is taken for a uniform signature.
        num_parts: Number of parts (ranks), ``1 <= num_parts <= len(labels)``.
        seed: Seed, ``>= 0``; the same seed gives the same partition.

    Returns:
        The partition, named ``"iid(num_parts=<p>, seed=<s>)"``.

    Raises:
        TypeError: ``labels`` is not integer, or ``num_parts``/``seed`` is not an int.
        ValueError: ``labels`` is empty or negative, ``num_parts`` is out of range, or
            ``seed < 0``.

    Example:
        >>> iid([0, 1, 0, 1, 2], num_parts=2).sizes
        array([3, 2])
    """
    y = as_labels(labels)
    num_parts = _check_num_parts(num_parts, len(y))
    seed = check_seed(seed)
    order = np.random.default_rng(seed).permutation(len(y))
    return Partition(np.array_split(order, num_parts), name=f"iid({num_parts=}, {seed=})")


def dirichlet(
    labels: Sequence[int] | Any,
    num_parts: int,
    alpha: float,
    seed: int = 0,
    *,
    min_size: int = 10,
) -> Partition:
    """Label skew drawn from a Dirichlet distribution (Hsu et al., 2019).

    For every class ``c``, proportions ``q_c ~ Dir(alpha * 1_P)`` over the ``P`` parts are
    drawn and the shuffled indices of class ``c`` are cut at the cumulative proportions,
    so every index goes to exactly one part. Small ``alpha`` puts each class on few parts
    (``alpha = 0.1``: most parts see two or three classes); large ``alpha`` tends to the
    IID split (``alpha = 100``). This is the per-class form of Hsu, Qi and Brown,
    *Measuring the Effects of Non-Identical Data Distribution for Federated Visual
    Classification* (arXiv:1909.06335), as implemented in NIID-Bench (Li et al., *Federated
    Learning on Non-IID Data Silos*, ICDE 2022), including its balancing rule: a part that
    already holds ``n / P`` samples gets no share of the classes still to deal (the
    proportions of class ``c`` are drawn over the other parts only). If some
    part ends below ``min_size`` samples, the whole draw is repeated (up to 1000 times,
    continuing the same random stream, so the result stays a function of ``seed``).

    Args:
        labels: The dataset's labels: a sequence, array or tensor of class indices ``>= 0``.
        num_parts: Number of parts (ranks), ``1 <= num_parts <= len(labels)``.
        alpha: Concentration, ``> 0``; smaller is more skewed.
        seed: Seed, ``>= 0``.
        min_size: Fewest samples a part may get, ``>= 1`` (NIID-Bench's 10 by default);
            ``min_size * num_parts`` may not exceed ``len(labels)``.

    Returns:
        The partition, named ``"dirichlet(num_parts=<p>, alpha=<a>, seed=<s>)"``.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``alpha <= 0``, ``num_parts`` or ``min_size`` is out of range, or no
            draw met ``min_size`` (lower ``min_size`` or raise ``alpha``).
    """
    y = as_labels(labels)
    num_parts = _check_num_parts(num_parts, len(y))
    alpha = check_positive_float(alpha, "alpha")
    seed = check_seed(seed)
    min_size = check_int(min_size, "min_size", minimum=1)
    if min_size * num_parts > len(y):
        raise ValueError(
            f"min_size must be <= len(labels) / num_parts = {len(y)} / {num_parts}; got {min_size}"
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    fair_share = len(y) / num_parts
    for _ in range(_DIRICHLET_TRIES):
        chunks: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
        sizes = np.zeros(num_parts, dtype=np.int64)
        for members in by_class:
            members = rng.permutation(members)
            # Drawing over the open parts only is the same law as NIID-Bench's draw over all
            # parts, masked and renormalised (a Dirichlet's renormalised sub-vector is
            # Dirichlet), and it cannot leave every open share underflowed to zero.
            open_parts = np.flatnonzero(sizes < fair_share)
            share = np.zeros(num_parts)
            share[open_parts] = rng.dirichlet(np.full(len(open_parts), alpha))
            cuts = (np.cumsum(share) * len(members)).astype(np.int64)[:-1]
            for part, piece in enumerate(np.split(members, cuts)):
                chunks[part].append(piece)
                sizes[part] += len(piece)
        if sizes.min() >= min_size:
            return Partition(
                [np.concatenate(c) for c in chunks],
                name=f"dirichlet({num_parts=}, {alpha=}, {seed=})",
            )
    raise ValueError(
        f"min_size={min_size} was not met by any of {_DIRICHLET_TRIES} draws with "
        f"alpha={alpha} and num_parts={num_parts}; lower min_size or raise alpha"
    )


def shards(
    labels: Sequence[int] | Any, num_parts: int, classes_per_part: int, seed: int = 0
) -> Partition:
    """Give every part exactly ``classes_per_part`` classes (McMahan et al., 2017).

    The pathological non-IID split of *Communication-Efficient Learning of Deep Networks
    from Decentralized Data* (FedAvg; there, 2 shards of sorted MNIST per client), with
    shards cut inside classes: in McMahan's sort-and-cut scheme a shard can straddle two
    classes and a client can draw two shards of one class, here every part holds exactly
    ``k = classes_per_part`` distinct classes (NIID-Bench's ``#C=k`` split).

    Method: every class gets a quota of ``floor(P*k/C)`` or ``ceil(P*k/C)`` holders (the
    larger quotas go to the classes with the most samples) so that the quotas sum to
    ``P*k``. The parts, in a
    random order, each take the ``k`` classes with the largest remaining quota, ties
    broken at random; this greedy rule always fills every quota with distinct classes per
    part (it is the constructive proof of the Gale-Ryser theorem), and the random ties
    make the class combinations vary. Each class's shuffled indices are then split into
    near-equal chunks (``numpy.array_split``) among its holders. No index is dropped.

    Args:
        labels: The dataset's labels: a sequence, array or tensor of class indices ``>= 0``.
        num_parts: Number of parts (ranks), ``>= 1``; ``num_parts * classes_per_part``
            must be at least the number of classes, so that every sample has an owner.
        classes_per_part: Classes per part, ``1 <= k <=`` number of distinct labels.
        seed: Seed, ``>= 0``.

    Returns:
        The partition, named ``"shards(num_parts=<p>, classes_per_part=<k>, seed=<s>)"``.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``classes_per_part`` exceeds the number of classes, ``num_parts *
            classes_per_part`` is below it, or a class has fewer samples than holders.

    Example:
        >>> p = shards([0, 0, 1, 1, 2, 2], num_parts=3, classes_per_part=1)
        >>> sorted(p.sizes.tolist())
        [2, 2, 2]
    """
    y = as_labels(labels)
    num_parts = _check_num_parts(num_parts, len(y))
    k = check_int(classes_per_part, "classes_per_part", minimum=1)
    seed = check_seed(seed)
    classes = np.unique(y)
    if k > len(classes):
        raise ValueError(
            f"classes_per_part must be <= the number of classes ({len(classes)}); got {k}"
        )
    if num_parts * k < len(classes):
        raise ValueError(
            f"num_parts * classes_per_part = {num_parts} * {k} must cover all "
            f"{len(classes)} classes, or some samples would have no part"
        )
    rng = np.random.default_rng(seed)
    counts = np.array([np.count_nonzero(y == c) for c in classes])
    quota = np.full(len(classes), num_parts * k // len(classes))
    # The extra holders go to the largest classes (ties at random), so small classes are
    # cut into fewer, larger chunks.
    quota[np.lexsort((rng.random(len(classes)), -counts))[: num_parts * k % len(classes)]] += 1
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for part in rng.permutation(num_parts):
        # np.lexsort sorts by its last key first: largest quota, then a random tie-break.
        chosen = np.lexsort((rng.random(len(classes)), -quota))[:k]
        quota[chosen] -= 1
        for c in classes[chosen]:
            holders[int(c)].append(int(part))
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
    for c, parts in holders.items():
        members = rng.permutation(np.flatnonzero(y == c))
        if len(members) < len(parts):
            raise ValueError(
                f"class {c} has {len(members)} samples but {len(parts)} parts must hold it; "
                f"lower num_parts or classes_per_part (got {num_parts}, {k})"
            )
        for part, piece in zip(parts, np.array_split(members, len(parts)), strict=True):
            chunks[part].append(piece)
    return Partition(
        [np.concatenate(c) for c in chunks],
        name=f"shards({num_parts=}, classes_per_part={k}, {seed=})",
    )
