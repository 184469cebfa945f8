"""Bytes on the wire: the counters and the timeline against the payload sizes, exactly.

Every expected count is computed here from the sizes of what the call sends: a call header
is HEADER_LEN int64 values, a payload is its tensor's bytes or the compressor's
``payload_nbytes``, and collectives follow the ring costs of gossamer.profiling.counters.
"""

import json

import pytest
import torch

import gossamer
from gossamer import communicators, profiling
from gossamer import topology as topo
from gossamer.compression import get_compressor
from gossamer.testing import run_distributed
from gossamer.transport import HEADER_LEN

HEAD = HEADER_LEN * 8


def _x(numel=1000):
    return torch.randn(numel, generator=torch.Generator().manual_seed(gossamer.rank()))


def _neighbor_and_choco(spec):
    n = gossamer.size()
    graph = topo.exponential_two(n)
    x = _x()
    profiling.reset_bytes_sent()
    gossamer.neighbor_allreduce(x, topology=graph)
    plain = profiling.bytes_sent_by_op()
    profiling.reset_bytes_sent()
    comm = communicators.ChocoGossip(spec, topology=graph)
    rounds = []
    for _ in range(2):
        profiling.reset_bytes_sent()
        comm.next_round()
        comm.start(x, 0).wait()
        rounds.append(profiling.bytes_sent_by_op())
    return len(graph.out_neighbors(gossamer.rank())), plain, rounds


@pytest.mark.parametrize("world_size", [2, 4])
def test_neighbor_exchange_counts_headers_and_payloads_exactly(world_size):
    c = get_compressor("uint8")
    for degree, plain, rounds in run_distributed(_neighbor_and_choco, world_size, args=("uint8",)):
        assert plain == {"neighbor_allreduce": degree * (HEAD + 1000 * 4)}
        # CHOCO's rounds are posted: the first checks the layout with one header allgather
        # over every rank, later ones send the payloads alone.
        payloads = degree * c.payload_nbytes(1000)
        first = {"compressed_gossip": (world_size - 1) * HEAD + payloads}
        assert rounds == [first, {"compressed_gossip": payloads}]
        assert c.payload_nbytes(1000) == 1008  # a quarter of float32's, plus a min/max pair


def _allreduces(spec):
    x = _x(1001)
    profiling.reset_bytes_sent()
    gossamer.allreduce(x)
    plain = profiling.bytes_sent_by_op()
    profiling.reset_bytes_sent()
    comm = communicators.CompressedAllreduce(spec)
    comm.next_round()
    comm.start(x, 0).wait()
    return plain, profiling.bytes_sent_by_op()


def test_collective_counts_follow_the_ring_costs():
    n = 3
    c = get_compressor("topk:0.1")
    for plain, sparse in run_distributed(_allreduces, n, args=("topk:0.1",)):
        assert plain == {"allreduce": (n - 1) * HEAD + 2 * (n - 1) * 1001 * 4 // n}
        # A bucket's first round checks the call (one header allgather: payloads hide the
        # dtype); then an allgather of the payload sizes and one of the payloads.
        assert sparse == {
            "compressed_allreduce": (n - 1) * HEAD,
            "allgather": (n - 1) * (2 * HEAD + 8 + c.payload_nbytes(1001)),
        }
    for _, uint8 in run_distributed(_allreduces, n, args=("uint8",)):
        per = -(-1001 // n)
        chunk = get_compressor("uint8").payload_nbytes(per)
        # The checked call sets the sizes, so its alltoall and allgather send no header.
        assert uint8 == {
            "compressed_allreduce": (n - 1) * HEAD,
            "alltoall": (n - 1) * (n * chunk) // n,
            "allgather": (n - 1) * chunk,
        }


def _traced(path):
    graph = topo.exponential_two(gossamer.size())
    comm = communicators.ChocoGossip("uint8", topology=graph)
    with profiling.tracing(path):
        profiling.reset_bytes_sent()
        comm.next_round()
        comm.start(_x(), 0).wait()
        gossamer.neighbor_allreduce(_x(), topology=graph)
    return profiling.bytes_sent_by_op()


def test_timeline_shows_the_bytes_of_each_operation(tmp_path):
    counts = run_distributed(_traced, 2, args=(str(tmp_path / "trace"),))
    for rank, counted in enumerate(counts):
        with open(tmp_path / f"trace.rank{rank}.json") as f:
            events = json.load(f)["traceEvents"]
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        # Bytes of a job of the communication thread are on its "running" span; a posted
        # round (CHOCO's) puts what it sends on a "sent" span of its row, and the header
        # check of its first round (an allgather, a job of the thread) on a "running" one.
        spans = [
            (rows[e["tid"]], e["name"], e.get("args", {}).get("bytes"))
            for e in events
            if e["ph"] == "X"
        ]
        running = {row: n for row, what, n in spans if what == "running" and n}
        assert running == {
            "neighbor_allreduce": counted["neighbor_allreduce"],
            "compressed_gossip": HEAD,
        }
        sent = sum(n for row, what, n in spans if row == "compressed_gossip" and n)
        assert sent == counted["compressed_gossip"] == HEAD + 1008
        assert ("compressed_gossip", "communicating", None) in spans
