"""Partitioners, skew measures and the BatchNorm swap against independent references."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gossamer.data import (
    Partition,
    PartSampler,
    batchnorm_to_groupnorm,
    default_num_groups,
    dirichlet,
    iid,
    label_histograms,
    shards,
    skew,
)


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    """``per_class`` samples of every class, in a shuffled order."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def unbalanced_labels(seed: int = 0) -> np.ndarray:
    """Seven classes with 5 to 200 samples each."""
    sizes = [200, 5, 60, 120, 33, 90, 17]
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(sizes)), sizes))


LABELS = {
    "balanced-10x100": balanced_labels(10, 100),
    "balanced-4x50": balanced_labels(4, 50, seed=3),
    "unbalanced-7": unbalanced_labels(),
}

PARTITIONERS = {
    "iid": lambda y, p, seed: iid(y, p, seed),
    "dirichlet-0.5": lambda y, p, seed: dirichlet(y, p, 0.5, seed, min_size=2),
    "dirichlet-100": lambda y, p, seed: dirichlet(y, p, 100.0, seed, min_size=2),
    # Two classes per part, or as many as it takes for the parts to cover every class.
    "shards": lambda y, p, seed: shards(y, p, max(2, -(-len(np.unique(y)) // p)), seed),
}


def reference_histograms(parts: list[np.ndarray], labels: np.ndarray, num_classes: int):
    table = np.zeros((len(parts), num_classes), dtype=np.int64)
    for r, part in enumerate(parts):
        for label, count in Counter(int(labels[i]) for i in part).items():
            table[r, label] = count
    return table


def reference_tv(parts: list[np.ndarray], labels: np.ndarray) -> list[float]:
    everything = Counter(int(labels[i]) for part in parts for i in part)
    total = sum(everything.values())
    out = []
    for part in parts:
        mine = Counter(int(labels[i]) for i in part)
        out.append(0.5 * sum(abs(mine[c] / len(part) - everything[c] / total) for c in everything))
    return out


# --- every partitioner -----------------------------------------------------------------------


@pytest.mark.parametrize("labels_id", list(LABELS))
@pytest.mark.parametrize("num_parts", [1, 3, 8])
@pytest.mark.parametrize("method", list(PARTITIONERS))
def test_partition_uses_every_index_exactly_once(method, num_parts, labels_id):
    labels = LABELS[labels_id]
    partition = PARTITIONERS[method](labels, num_parts, 7)
    assert partition.num_parts == num_parts
    everything = np.concatenate([partition.part(r) for r in range(num_parts)])
    assert sorted(everything.tolist()) == list(range(len(labels)))
    assert partition.num_samples == len(labels)
    for r in range(num_parts):
        part = partition.part(r)
        assert part.dtype == np.int64
        assert len(part) > 0
        assert np.all(np.diff(part) > 0)  # documented: sorted ascending
        assert not part.flags.writeable


@pytest.mark.parametrize("method", list(PARTITIONERS))
def test_partition_is_a_function_of_the_seed(method):
    labels = LABELS["balanced-10x100"]
    first = PARTITIONERS[method](labels, 6, 11)
    again = PARTITIONERS[method](labels.tolist(), 6, 11)
    assert first == again
    assert hash(first) == hash(again)
    other = PARTITIONERS[method](labels, 6, 12)
    assert first != other


@pytest.mark.parametrize("method", list(PARTITIONERS))
def test_partition_accepts_tensor_labels(method):
    labels = LABELS["balanced-4x50"]
    from_numpy = PARTITIONERS[method](labels, 4, 0)
    from_tensor = PARTITIONERS[method](torch.from_numpy(labels), 4, 0)
    assert from_numpy == from_tensor


def test_iid_sizes_differ_by_at_most_one_and_match_a_permutation():
    labels = LABELS["unbalanced-7"]
    partition = iid(labels, 6, seed=5)
    order = np.random.default_rng(5).permutation(len(labels))
    expected = [np.sort(chunk) for chunk in np.array_split(order, 6)]
    for r in range(6):
        np.testing.assert_array_equal(partition.part(r), expected[r])
    assert partition.sizes.max() - partition.sizes.min() <= 1


@pytest.mark.parametrize("labels_id", list(LABELS))
@pytest.mark.parametrize(("num_parts", "k"), [(10, 1), (10, 2), (8, 3), (20, 2), (4, 4)])
def test_shards_give_exactly_k_classes_per_part(labels_id, num_parts, k):
    labels = LABELS[labels_id]
    num_classes = len(np.unique(labels))
    partition = shards(labels, num_parts, k, seed=3)
    table = reference_histograms(list(partition.parts), labels, num_classes)
    assert ((table > 0).sum(axis=1) == k).all()
    # Every class is shared among floor or ceil(P*k/C) holders.
    holders = (table > 0).sum(axis=0)
    assert holders.min() >= num_parts * k // num_classes
    assert holders.max() <= -(-num_parts * k // num_classes)


def test_shards_vary_the_class_combinations():
    labels = LABELS["balanced-10x100"]
    table = label_histograms(shards(labels, 20, 2, seed=0), labels)
    combos = {tuple(np.flatnonzero(row)) for row in table}
    assert len(combos) > 5  # a fixed pairing would give exactly 5


@pytest.mark.parametrize("num_parts", [4, 10, 20])
def test_dirichlet_skew_grows_as_alpha_shrinks(num_parts):
    labels = LABELS["balanced-10x100"]
    means = [
        skew(dirichlet(labels, num_parts, alpha, seed=s, min_size=5), labels).mean
        for alpha in (0.1, 1.0, 100.0)
        for s in range(3)
    ]
    low, mid, high = (np.mean(means[i : i + 3]) for i in (0, 3, 6))
    assert low > mid > high
    assert high < 0.15
    assert low > 0.5


def test_dirichlet_respects_min_size():
    labels = LABELS["balanced-10x100"]
    partition = dirichlet(labels, 20, 0.1, seed=1, min_size=20)
    assert partition.sizes.min() >= 20


# --- argument errors name the argument and the value ------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda y: iid(y, 0), ValueError, "num_parts must be >= 1; got 0"),
        (lambda y: iid(y, 201), ValueError, r"num_parts must be <= .*\(200\); got 201"),
        (lambda y: iid(y, 2.0), TypeError, "num_parts must be an int; got 2.0"),
        (lambda y: iid(y, 2, seed=-1), ValueError, "seed must be >= 0; got -1"),
        (lambda y: iid(y.astype(float), 2), TypeError, "labels must hold integers.*float64"),
        (lambda y: iid(y.reshape(2, -1), 2), ValueError, r"labels must be 1-D; got shape"),
        (lambda y: iid([], 2), ValueError, "labels must not be empty"),
        (lambda y: iid([0, -3, 1], 2), ValueError, "labels must be >= 0; got -3 at position 1"),
        (lambda y: iid(None, 2), TypeError, "labels must be"),
        (lambda y: dirichlet(y, 4, 0.0), ValueError, "alpha must be finite and > 0; got 0.0"),
        (lambda y: dirichlet(y, 4, -1), ValueError, "alpha must be finite and > 0; got -1"),
        (lambda y: dirichlet(y, 4, float("nan")), ValueError, "alpha must be finite"),
        (lambda y: dirichlet(y, 4, "1"), TypeError, "alpha must be a number; got '1'"),
        (lambda y: dirichlet(y, 4, 1.0, min_size=0), ValueError, "min_size must be >= 1; got 0"),
        (lambda y: dirichlet(y, 4, 1.0, min_size=101), ValueError, "min_size must be <= .*101"),
        (lambda y: dirichlet(y, 10, 1e-3, min_size=10), ValueError, "min_size=10 was not met"),
        (lambda y: shards(y, 4, 0), ValueError, "classes_per_part must be >= 1; got 0"),
        (lambda y: shards(y, 4, 5), ValueError, r"classes_per_part must be <= .*\(4\); got 5"),
        (lambda y: shards(y, 1, 2), ValueError, r"num_parts \* classes_per_part = 1 \* 2"),
        (lambda y: shards(np.arange(5), 4, 2), ValueError, "class .* has 1 samples but 2 parts"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_partitioner_errors_name_argument_and_value(call, error, match):
    with pytest.raises(error, match=match):
        call(LABELS["balanced-4x50"].copy())


# --- Partition and its sampler ---------------------------------------------------------------


def test_partition_by_hand_is_sorted_and_validated():
    partition = Partition([[4, 0], torch.tensor([1, 3, 2])], name="hand")
    np.testing.assert_array_equal(partition.part(0), [0, 4])
    np.testing.assert_array_equal(partition.sizes, [2, 3])
    assert repr(partition) == "Partition(name='hand', num_parts=2, num_samples=5)"
    with pytest.raises(ValueError, match=r"index 3 appears more than once \(parts \[0, 1\]\)"):
        Partition([[3, 1], [3]])
    with pytest.raises(ValueError, match=r"parts\[1\] must not be empty"):
        Partition([[0], []])
    with pytest.raises(TypeError, match=r"parts\[0\] must hold integer indices"):
        Partition([[0.5]])
    with pytest.raises(ValueError, match=r"parts must hold at least one part; got 0"):
        Partition([])
    with pytest.raises(TypeError, match="parts must be a sequence"):
        Partition(np.arange(3))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\); got 2"):
        partition.part(2)
    with pytest.raises(TypeError, match="rank must be an int"):
        partition.sampler("0")


@pytest.mark.parametrize("rank", [0, 3])
def test_sampler_covers_its_part_and_reshuffles_per_epoch(rank):
    labels = LABELS["balanced-10x100"]
    partition = dirichlet(labels, 5, 1.0, seed=0)
    sampler = partition.sampler(rank, seed=2)
    assert len(sampler) == partition.sizes[rank]
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == partition.part(rank).tolist()
        assert order == list(sampler)  # same epoch, same order
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]
    twin = partition.sampler(rank, seed=2)
    twin.set_epoch(1)
    assert list(twin) == orders[1]  # deterministic across processes
    plain = partition.sampler(rank, shuffle=False)
    assert list(plain) == partition.part(rank).tolist()


def test_sampler_orders_differ_across_ranks_with_one_seed():
    partition = iid(np.zeros(40, dtype=np.int64), 2, seed=0)
    firsts = []
    for rank in range(2):
        order = np.asarray(list(partition.sampler(rank, seed=0)))
        firsts.append(np.searchsorted(partition.part(rank), order))  # positions, not indices
    assert not np.array_equal(firsts[0], firsts[1])


def test_sampler_num_samples_wraps_and_truncates():
    partition = Partition([[0, 1, 2], [3, 4, 5, 6, 7]])
    longer = partition.sampler(0, num_samples=int(partition.sizes.max()))
    order = list(longer)
    assert len(order) == len(longer) == 5
    assert order[3:] == order[:2] and sorted(order[:3]) == [0, 1, 2]
    shorter = partition.sampler(1, num_samples=2)
    assert len(list(shorter)) == 2 and set(shorter) <= {3, 4, 5, 6, 7}
    with pytest.raises(ValueError, match="num_samples must be >= 1; got 0"):
        partition.sampler(0, num_samples=0)
    with pytest.raises(ValueError, match="epoch must be >= 0; got -1"):
        longer.set_epoch(-1)
    with pytest.raises(TypeError, match="shuffle must be a bool"):
        PartSampler([1, 2], shuffle=1)


def test_sampler_and_subset_feed_a_dataloader():
    labels = torch.from_numpy(LABELS["balanced-4x50"])
    dataset = TensorDataset(torch.arange(len(labels)), labels)
    partition = shards(labels, 4, 1, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=partition.sampler(2))
    seen = torch.cat([index for index, _ in loader])
    assert sorted(seen.tolist()) == partition.part(2).tolist()
    subset = partition.subset(dataset, 2)
    assert len(subset) == partition.sizes[2]
    assert len({int(label) for _, label in subset}) == 1
    with pytest.raises(ValueError, match="dataset has 3 samples"):
        partition.subset(TensorDataset(torch.arange(3)), 2)


# --- skew measures -------------------------------------------------------------------------


@pytest.mark.parametrize("labels_id", list(LABELS))
@pytest.mark.parametrize("method", list(PARTITIONERS))
def test_histograms_and_skew_match_counting(method, labels_id):
    labels = LABELS[labels_id]
    partition = PARTITIONERS[method](labels, 5, 1)
    num_classes = int(labels.max()) + 1
    np.testing.assert_array_equal(
        label_histograms(partition, labels),
        reference_histograms(list(partition.parts), labels, num_classes),
    )
    per_part, mean = skew(partition, labels)
    np.testing.assert_allclose(per_part, reference_tv(list(partition.parts), labels), atol=1e-12)
    assert mean == pytest.approx(np.mean(per_part))


def test_skew_of_k_balanced_classes_is_one_minus_k_over_c():
    labels = np.repeat(np.arange(10), 20)
    partition = Partition([np.flatnonzero(labels < 2), np.flatnonzero(labels >= 2)])
    per_part, _ = skew(partition, labels)
    # Part 0 holds 2 of 10 classes; part 1 holds the other 8.
    np.testing.assert_allclose(per_part, [0.8, 0.2])


def test_histograms_errors():
    partition = Partition([[0, 5]])
    with pytest.raises(ValueError, match="partition holds index 5 but labels has only 3"):
        label_histograms(partition, [0, 1, 2])
    with pytest.raises(ValueError, match="labels must be < num_classes=2; got 2"):
        label_histograms(Partition([[0]]), [0, 1, 2], num_classes=2)
    with pytest.raises(TypeError, match="partition must be a Partition; got list"):
        skew([[0]], [0])
    wide = label_histograms(Partition([[0, 1]]), [0, 1], num_classes=4)
    np.testing.assert_array_equal(wide, [[1, 1, 0, 0]])


# --- BatchNorm -> GroupNorm ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("channels", "groups"), [(1, 1), (10, 10), (16, 16), (32, 32), (48, 24), (64, 32), (37, 1)]
)
def test_default_num_groups_is_the_largest_divisor_up_to_32(channels, groups):
    assert default_num_groups(channels) == groups


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 48, 3)
        self.bn2 = nn.BatchNorm2d(48)
        self.block = nn.Sequential(nn.Flatten(), nn.Linear(48, 12), nn.BatchNorm1d(12))
        self.bn3 = nn.BatchNorm3d(8, affine=False, eps=1e-3)

    def forward(self, x):
        return self.block(nn.functional.adaptive_avg_pool2d(self.bn2(self.conv(x)), 1))


def test_batchnorm_to_groupnorm_replaces_every_layer_in_place():
    net = Net()
    with torch.no_grad():
        net.bn2.weight.uniform_()
        net.bn2.bias.uniform_()
    original = copy.deepcopy(net)
    out = batchnorm_to_groupnorm(net)
    assert out is net
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert (net.bn2.num_groups, net.bn2.num_channels, net.bn2.affine) == (24, 48, True)
    assert (net.block[2].num_groups, net.block[2].num_channels) == (1, 12)  # 1d: one group
    assert (net.bn3.num_groups, net.bn3.affine, net.bn3.eps) == (8, False, 1e-3)
    torch.testing.assert_close(net.bn2.weight, original.bn2.weight)
    torch.testing.assert_close(net.bn2.bias, original.bn2.bias)
    # The forward pass is GroupNorm's: per sample, so one sample's output ignores the batch.
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(net(x)[:1], net(x[:1]))
    reference = nn.functional.group_norm(
        original.conv(x), 24, original.bn2.weight, original.bn2.bias, original.bn2.eps
    )
    torch.testing.assert_close(net.bn2(net.conv(x)), reference)


def test_batchnorm_to_groupnorm_user_groups_and_errors():
    net = batchnorm_to_groupnorm(Net(), num_groups=4)
    assert {m.num_groups for m in net.modules() if isinstance(m, nn.GroupNorm)} == {4}
    untouched = Net()
    with pytest.raises(ValueError, match=r"num_groups=5 does not divide the 48 channels.*'bn2'"):
        batchnorm_to_groupnorm(untouched, num_groups=5)
    assert isinstance(untouched.bn2, nn.BatchNorm2d)  # checked before anything changed
    with pytest.raises(ValueError, match=r"'block\.2'"):
        batchnorm_to_groupnorm(Net(), num_groups=8)
    with pytest.raises(ValueError, match="num_groups must be >= 1; got 0"):
        batchnorm_to_groupnorm(Net(), num_groups=0)
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module; got str"):
        batchnorm_to_groupnorm("net")
    with pytest.raises(ValueError, match="lazy BatchNorm"):
        batchnorm_to_groupnorm(nn.Sequential(nn.LazyBatchNorm1d()))


def test_batchnorm_to_groupnorm_on_a_bare_layer_and_a_shared_layer():
    gn = batchnorm_to_groupnorm(nn.BatchNorm2d(6).eval())
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == 6 and not gn.training
    shared = nn.BatchNorm3d(4)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    batchnorm_to_groupnorm(net)
    assert isinstance(net[0], nn.GroupNorm) and net[0] is net[2] and net[0].num_groups == 4


def test_batchnorm1d_becomes_one_group_that_normalises_each_sample():
    mlp = batchnorm_to_groupnorm(nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8)))
    out = mlp(torch.randn(1, 5))  # a batch of one is fine for GroupNorm, not for BatchNorm
    torch.testing.assert_close(out.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
