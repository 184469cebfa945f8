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
