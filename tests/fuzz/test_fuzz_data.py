"""Fuzz gossamer.data: the partitioners, Partition and PartSampler.

Pure numpy, so it runs in the test process. Valid arguments must give a partition that
uses every index once and has the documented shape; bad ones must raise TypeError or
ValueError naming the argument.
"""

import numpy as np
import torch
from fuzz_cases import FUZZ, Arg, bad, bad_int, call, flag, good, mostly, verdict
from hypothesis import example, given
from hypothesis import strategies as st

from gossamer import data


@st.composite
def label_sets(draw):
    n = draw(st.integers(1, 60))
    classes = draw(st.integers(1, 6))
    labels = draw(st.lists(st.integers(0, classes - 1), min_size=n, max_size=n))
    form = draw(st.sampled_from(["list", "array", "tensor", "int32"]))
    if form == "array":
        return Arg(np.array(labels))
    if form == "tensor":
        return Arg(torch.tensor(labels))
    if form == "int32":
        return Arg(np.array(labels, dtype=np.int32))
    return Arg(labels)


BAD_LABELS = st.one_of(
    bad(st.sampled_from([[], np.zeros(0, dtype=np.int64)]), "empty"),
    bad(st.sampled_from([[0.0, 1.0], np.ones(3), torch.ones(3)]), "floats"),
    bad(st.sampled_from([[0, -1], np.array([2, -3])]), "negative"),
    bad(st.sampled_from([[[0, 1]], np.zeros((2, 2), dtype=int)]), "not 1-D"),
    bad(st.sampled_from([None, "0101", [True, False], [0, None], [[0], [1, 2]]]), "type"),
)


def labels_arg():
    return mostly(label_sets(), BAD_LABELS, 5)


def size_of(labels):
    return len(labels.value) if labels.bad is None else 1


def assert_partition(partition, n, num_parts):
    assert partition.num_parts == num_parts
    assert sorted(np.concatenate(partition.parts).tolist()) == list(range(n))


def seeds():
    return mostly(good(st.integers(0, 2**32) | st.just(np.int64(7))), bad_int(0))


def parts_arg(n):
    return mostly(good(st.integers(1, n)), bad_int(1, n), 5)


@FUZZ
@given(labels=labels_arg(), data_=st.data(), seed=seeds())
def test_iid(labels, data_, seed):
    num_parts = data_.draw(parts_arg(size_of(labels)), "num_parts")
    args = {"labels": labels, "num_parts": num_parts, "seed": seed}
    partition = verdict(call(data.iid, labels.value, num_parts.value, seed.value), args)
    if partition is None:
        return
    n = len(labels.value)
    assert_partition(partition, n, num_parts.value)
    assert partition.sizes.max() - partition.sizes.min() <= 1
    assert partition == data.iid(labels.value, num_parts.value, seed.value)


@FUZZ
@given(
    labels=labels_arg(),
    data_=st.data(),
    alpha=mostly(
        good(st.floats(0.05, 100) | st.integers(1, 5)),
        bad(st.sampled_from([0, -1.0, float("nan"), float("inf"), "1", None, True]), "alpha"),
    ),
    seed=seeds(),
    min_size=mostly(good(st.integers(1, 3)), bad_int(1), 8),
)
def test_dirichlet(labels, data_, alpha, seed, min_size):
    n = size_of(labels)
    num_parts = data_.draw(parts_arg(n), "num_parts")
    args = {
        "labels": labels,
        "num_parts": num_parts,
        "alpha": alpha,
        "seed": seed,
        "min_size": min_size,
    }
    extra = {}
    if num_parts.bad is None and min_size.bad is None and min_size.value * num_parts.value > n:
        extra["min_size"] = "min_size * num_parts > len(labels)"
    result, error = call(
        data.dirichlet, labels.value, num_parts.value, alpha.value, seed.value,
        min_size=min_size.value,
    )  # fmt: skip
    all_valid = not extra and all(a.bad is None for a in args.values())
    if all_valid and isinstance(error, ValueError) and "min_size" in str(error):
        return  # documented: no draw met min_size (a valid request that is hopeless)
    partition = verdict((result, error), args, extra_bad=extra)
    if partition is None:
        return
    assert_partition(partition, n, num_parts.value)
    assert partition.sizes.min() >= min_size.value


@FUZZ
@given(labels=labels_arg(), data_=st.data(), seed=seeds())
def test_shards(labels, data_, seed):
    n = size_of(labels)
    num_parts = data_.draw(parts_arg(n), "num_parts")
    k = data_.draw(mostly(good(st.integers(1, 6)), bad_int(1)), "classes_per_part")
    args = {"labels": labels, "num_parts": num_parts, "classes_per_part": k, "seed": seed}
    extra = {}
    if all(a.bad is None for a in args.values()):
        y = np.asarray(labels.value)
        classes, counts = np.unique(y, return_counts=True)
        if k.value > len(classes):
            extra["classes_per_part"] = "more than the classes"
        elif num_parts.value * k.value < len(classes):
            extra["classes_per_part"] = "parts do not cover the classes"
        elif num_parts.value * k.value > 0:
            # A class cannot have more holders than samples (documented ValueError).
            holders = -(-num_parts.value * k.value // len(classes))
            if counts.min() < holders:
                extra["num_parts"] = "a class has fewer samples than holders"
    names = {"num_parts": ("classes_per_part",), "classes_per_part": ("num_parts",)}
    outcome = call(data.shards, labels.value, num_parts.value, k.value, seed.value)
    if "num_parts" in extra and outcome[1] is None:
        return  # the quota rule may give the small class fewer holders than the ceiling
    partition = verdict(outcome, args, names=names, extra_bad=extra)
    if partition is None:
        return
    y = np.asarray(labels.value)
    assert_partition(partition, n, num_parts.value)
    for part in partition.parts:
        assert len(np.unique(y[part])) == k.value


@FUZZ
@given(
    parts=mostly(
        good(
            st.lists(st.integers(0, 30), unique=True, min_size=2, max_size=12).flatmap(
                lambda idx: st.integers(1, len(idx)).map(lambda p: [idx[i::p] for i in range(p)])
            )
        ),
        st.one_of(
            bad(st.sampled_from([[[1, 2], [2]], [[0], [0]]]), "index twice"),
            bad(st.sampled_from([[], [[]], [[1], []]]), "empty"),
            bad(st.sampled_from([[[-1]], [[0.5]], [["a"]], [[[0, 1], [2]]]]), "part"),
            bad(st.sampled_from([None, "01", np.array([[0, 1]]), 3]), "type"),
        ),
        2,
    ),
    rank=st.integers(-1, 13),
    shuffle=flag(),
    num_samples=mostly(good(st.none() | st.integers(1, 20)), bad_int(1, none_ok=True)),
    epoch=st.integers(0, 3),
)
# Found by this fuzzer: a ragged part raised numpy's ValueError, which names no argument.
@example(
    parts=Arg([[[0, 1], [2]]], "ragged part"),
    rank=0,
    shuffle=Arg(True),
    num_samples=Arg(None),
    epoch=0,
)
def test_partition_and_sampler(parts, rank, shuffle, num_samples, epoch):
    partition = verdict(call(data.Partition, parts.value), {"parts": parts})
    if partition is None:
        return
    rank_arg = Arg(rank, None if 0 <= rank < partition.num_parts else "out of range")
    args = {"rank": rank_arg, "shuffle": shuffle, "num_samples": num_samples}
    sampler = verdict(
        call(partition.sampler, rank, shuffle=shuffle.value, num_samples=num_samples.value),
        args,
    )
    if sampler is None:
        return
    part = sorted(parts.value[rank])
    sampler.set_epoch(epoch)
    drawn = list(sampler)
    expected_len = num_samples.value or len(part)
    assert len(drawn) == len(sampler) == expected_len
    assert set(drawn) <= set(part)
    if expected_len >= len(part):
        assert set(drawn) == set(part)
    if not shuffle.value:
        assert drawn == list(np.resize(part, expected_len))
