"""Fusion buckets: one flat buffer and a view of it per member tensor."""

import pytest
import torch

from gossamer.fusion import Bucket


def test_rebase_makes_a_new_buffer_the_bucket_without_copying():
    bucket = Bucket([torch.zeros(2, 3), torch.zeros(4)])
    flat = torch.arange(10.0)
    bucket.rebase(flat)
    assert bucket.flat is flat
    assert [v.data_ptr() for v in bucket.views] == [flat.data_ptr(), flat[6:].data_ptr()]
    assert torch.equal(bucket.views[0], flat[:6].view(2, 3))
    assert torch.equal(bucket.pack(lambda t: None), torch.zeros(10))  # packs into flat
    assert torch.equal(flat, torch.zeros(10))


@pytest.mark.parametrize(
    ("flat", "got"),
    [
        (torch.zeros(9), "got shape (9,), torch.float32"),
        (torch.zeros(10, dtype=torch.float64), "got shape (10,), torch.float64"),
        (torch.zeros(2, 5), "got shape (2, 5)"),
        (torch.zeros(20)[::2], "got shape (10,)"),
    ],
)
def test_rebase_refuses_another_layout_naming_it(flat, got):
    bucket = Bucket([torch.zeros(2, 3), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"contiguous 1-d torch.float32 tensor of 10 elements"):
        bucket.rebase(flat)
    with pytest.raises(ValueError, match=got.replace("(", r"\(").replace(")", r"\)")):
        bucket.rebase(flat)


def _members():
    """A weight, a bias, and a tensor that views a larger buffer (so owns no storage)."""
    weight = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    bias = torch.nn.Parameter(torch.tensor([10.0, 11.0]))
    shared = torch.arange(100.0, 108.0)[2:5]
    return weight, bias, shared


def test_adopt_moves_members_into_the_buffer_keeping_their_values():
    weight, bias, shared = _members()
    bucket = Bucket([weight, bias, shared])
    bucket.adopt()
    assert weight.data_ptr() == bucket.flat.data_ptr()
    assert bias.data_ptr() == bucket.flat[6:].data_ptr()
    assert shared.data_ptr() != bucket.flat[8:].data_ptr()  # a view of another buffer stays
    assert torch.equal(weight, torch.arange(6.0).view(2, 3))
    assert torch.equal(bias, torch.tensor([10.0, 11.0]))
    weight.data.mul_(2)  # a change to the parameter is a change to the buffer
    assert torch.equal(bucket.pack(), torch.tensor([0, 2, 4, 6, 8, 10, 10, 11, 102, 103, 104.0]))


def test_an_adopted_bucket_packs_other_sources_elsewhere_and_unpacks_into_its_members():
    weight, bias, shared = _members()
    bucket = Bucket([weight, bias, shared])
    bucket.adopt()
    members = bucket.pack().clone()
    grads = bucket.pack(lambda t: torch.ones_like(t))
    assert grads.data_ptr() != bucket.flat.data_ptr()
    assert torch.equal(grads, torch.ones(11))
    assert torch.equal(bucket.pack(lambda t: None), torch.zeros(11))
    assert torch.equal(bucket.flat, members)  # the members were never written
    bucket.unpack(torch.arange(11.0), lambda t: t.data)
    assert torch.equal(weight, torch.arange(6.0).view(2, 3))
    assert torch.equal(bias, torch.tensor([6.0, 7.0]))
    assert torch.equal(shared, torch.tensor([8.0, 9.0, 10.0]))
    bucket.flat[8:] = -1.0
    bucket.unpack(bucket.flat, lambda t: t.data)  # its own buffer: only `shared` is copied
    assert torch.equal(bucket.flat[:8], torch.arange(8.0))
    assert torch.equal(shared, torch.tensor([-1.0, -1.0, -1.0]))


def test_a_member_moved_out_after_adopt_is_copied_as_before():
    weight, bias, _ = _members()
    bucket = Bucket([weight, bias])
    bucket.adopt()
    weight.data = torch.full((2, 3), 5.0)  # as module.to() would
    assert torch.equal(bucket.pack(), torch.tensor([5.0] * 6 + [10.0, 11.0]))
    bucket.unpack(torch.arange(8.0), lambda t: t.data)
    assert torch.equal(weight, torch.arange(6.0).view(2, 3))
    assert torch.equal(bias, torch.tensor([6.0, 7.0]))
