"""A BlueFog program, unchanged but for its import, run on 4 ranks by `gossamer run`."""

import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(r"""
    import os

    import torch

    import gossamer.bluefog as bf
    from gossamer.bluefog import topology_util

    bf.init()
    bf.init()  # BlueFog programs and tests call init more than once
    assert bf.set_topology(topology_util.RingGraph(bf.size()))
    rank, size = bf.rank(), bf.size()
    assert bf.in_neighbor_ranks() == sorted({(rank - 1) % size, (rank + 1) % size})

    # Synchronous average consensus on the ring: converges to the mean (size - 1) / 2.
    x = torch.full((8,), float(rank), dtype=torch.float64)
    for _ in range(60):
        x = bf.neighbor_allreduce(x)
    static_error = (x - (size - 1) / 2).abs().max().item()

    # Dynamic one-peer exponential-2 steps with nonblocking calls.
    y = torch.full((8,), float(rank), dtype=torch.float64)
    steps = topology_util.GetDynamicOnePeerSendRecvRanks(bf.ExponentialTwoGraph(size), rank)
    for _ in range(6):
        send, recv = next(steps)
        w = 1.0 / (len(recv) + 1)
        handle = bf.neighbor_allreduce_nonblocking(
            y, self_weight=w, src_weights={r: w for r in recv}, dst_weights=send,
            enable_topo_check=False,
        )
        y = bf.synchronize(handle)
    dynamic_error = (y - (size - 1) / 2).abs().max().item()

    # Asynchronous push-sum with windows and the associated p.
    bf.turn_on_win_ops_with_associated_p()
    z = torch.full((8,), float(rank), dtype=torch.float64)
    assert bf.win_create(z, "z", zero_init=True)
    assert not bf.set_topology(bf.ExponentialTwoGraph(size))  # frozen while windows exist
    outdegree = len(bf.out_neighbor_ranks())
    for _ in range(40):
        bf.win_accumulate(
            z, "z", self_weight=1 / (outdegree + 1),
            dst_weights={d: 1 / (outdegree + 1) for d in bf.out_neighbor_ranks()},
            require_mutex=True,
        )
        bf.win_update_then_collect("z")
    bf.barrier()
    bf.win_update_then_collect("z")
    p = bf.win_associated_p("z")
    bf.barrier()
    push_sum_total = bf.allreduce(torch.tensor([p]), average=False).item()
    estimate_total = bf.allreduce(z.clone(), average=False)[0].item()
    bf.win_free()
    bf.turn_off_win_ops_with_associated_p()

    os.write(1, (
        f"rank {rank} of {size}: static {static_error:.1e} dynamic {dynamic_error:.1e} "
        f"mass {estimate_total:.6f} p {push_sum_total:.6f}\n"
    ).encode())
    bf.shutdown()
""")


def test_bluefog_program_runs_unchanged_under_gossamer_run(tmp_path):
    script = tmp_path / "consensus.py"
    script.write_text(PROGRAM)
    done = subprocess.run(
        [sys.executable, "-m", "gossamer.launcher", "run", "-np", "4", str(script)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == [f"rank {r} of 4" for r in range(4)]
    for line in lines:
        fields = line.split()
        static, dynamic = float(fields[5]), float(fields[7])
        assert static < 1e-6, line
        assert dynamic < 1e-12, line  # one-peer exp-2 averages exactly in log2(n) steps
        # push-sum keeps the total mass (sum of ranks) and the total weight (n)
        assert abs(float(fields[9]) - 6.0) < 1e-9 and abs(float(fields[11]) - 4.0) < 1e-9
