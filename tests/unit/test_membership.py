"""Membership agreement through a store, in one process: several ranks' views share a store."""

import json

import pytest
import torch.distributed as dist

from gossamer.errors import RankLostError
from gossamer.transport import Header, Membership


def _views(size=5):
    store = dist.HashStore()
    return store, [Membership(store, r, size) for r in range(size)]


def test_first_proposal_decides_an_epoch_and_later_ones_build_on_it():
    store, views = _views()
    seen = []
    views[0].on_change(lambda c: seen.append((c.epoch, c.live, c.dead, c.lost, c.settled_round)))
    assert views[1].report([3], round=7) == 1
    # rank 0 saw rank 4 die as well: epoch 1 is taken, so it adopts it and proposes epoch 2
    assert views[0].report([3, 4], round=8) == 2
    assert seen == [(1, (0, 1, 2, 4), (3,), (3,), 12), (2, (0, 1, 2), (3, 4), (4,), 13)]
    assert json.loads(store.get("gossamer/membership/1")) == {"dead": [3], "settled_round": 12}
    # reporting what is known proposes nothing new (it reads the later epochs first)
    assert views[1].report([3]) == 2
    assert views[2].refresh() == 2 and views[2].live == (0, 1, 2)


def test_catch_up_follows_a_header_epoch_and_fails_without_the_record():
    _, views = _views()
    views[0].report([1])
    views[2].catch_up(1)
    assert views[2].dead == {1}
    with pytest.raises(RankLostError, match="no epoch 2"):
        views[2].catch_up(2)


def test_a_rank_declared_dead_cannot_take_part():
    _, views = _views()
    views[0].report([2])
    with pytest.raises(RankLostError, match="rank 2 dead"):
        views[2].refresh()


def test_without_a_store_a_rank_keeps_its_own_view():
    view = Membership(None, 0, 3)
    assert view.report([2]) == 1 and view.live == (0, 1)


def test_header_carries_the_epoch_but_calls_match_across_epochs():
    head = Header("neighbor_allreduce", shape=(2,), epoch=3)
    back = Header.decode(head.encode())
    assert back.epoch == 3 and back.shape == (2,)
    assert back.matches(Header("neighbor_allreduce", shape=(2,), epoch=0))
