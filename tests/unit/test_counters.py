"""The bytes-sent counters: ring costs, per-operation totals, and their place on the timeline."""

import json
import threading

import pytest

from gossamer import profiling
from gossamer.profiling import timeline

pytestmark = pytest.mark.usefixtures("timeline_off")


def test_collective_costs_follow_the_ring_model():
    cost = profiling.collective_bytes
    assert cost("all_reduce", 1000, 4) == 1500  # 2 (n-1)/n M
    assert cost("all_reduce", 1000, 1) == 0
    assert cost("all_gather", 160, 4) == 480  # (n-1) M
    assert cost("all_to_all", 1200, 4) == 900
    assert cost("reduce_scatter", 1200, 3) == 800
    # A chain from root 1 over 4 ranks: 1 -> 2 -> 3 -> 0; rank 0 is last and sends nothing.
    assert [cost("broadcast", 100, 4, r, root=1) for r in range(4)] == [0, 100, 100, 100]
    assert [cost("gather", 100, 3, r, root=2) for r in range(3)] == [100, 100, 0]
    assert [cost("scatter", 300, 3, r, root=0) for r in range(3)] == [200, 0, 0]
    with pytest.raises(ValueError, match="collective"):
        cost("allreduce", 10, 2)


def test_counts_add_up_per_operation_and_reset():
    profiling.reset_bytes_sent()
    profiling.count_sent("neighbor_allreduce", 100)
    profiling.count_sent("neighbor_allreduce", 60)
    profiling.count_collective("allgather", "all_gather", 10, 3)
    profiling.count_sent("window.put", 0)  # nothing sent: no entry
    assert profiling.bytes_sent_by_op() == {"neighbor_allreduce": 160, "allgather": 20}
    assert profiling.bytes_sent() == 180
    assert profiling.bytes_sent("allgather") == 20
    assert profiling.bytes_sent("window.put") == 0
    profiling.reset_bytes_sent()
    assert profiling.bytes_sent() == 0


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: profiling.count_sent("x", float("nan")), "nbytes"),
        (lambda: profiling.count_sent("x", 2.5), "nbytes"),
        (lambda: profiling.count_sent("x", -1), "nbytes"),
        (lambda: profiling.collective_bytes("all_reduce", "100", 4), "nbytes"),
        (lambda: profiling.collective_bytes("all_reduce", 100, 0), "size"),
        (lambda: profiling.collective_bytes("all_reduce", 100, -3), "size"),
        (lambda: profiling.collective_bytes("broadcast", 100, 4, 0, None), "root"),
        (lambda: profiling.collective_bytes("gather", 100, 4, 4), "rank"),
        (lambda: profiling.collective_bytes("all_gather", 100, True), "size"),
    ],
)
def test_counters_refuse_counts_that_are_not_byte_counts(call, name):
    profiling.reset_bytes_sent()
    with pytest.raises(ValueError, match=name):
        call()
    assert profiling.bytes_sent() == 0  # nothing poisons the total


def test_timeline_puts_bytes_on_the_running_span_or_a_sent_span(tmp_path):
    def job():
        profiling.count_sent("neighbor_allreduce", 70)
        profiling.count_sent("neighbor_allreduce", 30)

    with timeline.tracing(tmp_path / "t"):
        timeline.traced("neighbor_allreduce", job)()
        worker = threading.Thread(target=profiling.count_sent, args=("window.put", 1174))
        worker.start()
        worker.join()
    with open(tmp_path / "t.rank0.json") as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    with_bytes = sorted((e["name"], e["args"]["bytes"]) for e in events if "args" in e)
    assert with_bytes == [("running", 100), ("sent", 1174)]
