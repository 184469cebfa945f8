"""Output forwarding: whole lines, once each, from real pipes and real ranks."""

import collections
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

from gossamer.launcher.output import MAX_LINE, Forwarder, make_fifo

# --------------------------------------------------------------------------- the forwarder


@pytest.fixture
def sink(tmp_path):
    """Files standing in for the launcher's stdout and stderr."""
    out, err = tmp_path / "out", tmp_path / "err"
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT) for p in (out, err)]
    yield out, err, fds
    for fd in fds:
        os.close(fd)


def _writer(fd, pieces):
    for piece in pieces:
        os.write(fd, piece)
    os.close(fd)


def test_pieces_of_lines_from_several_pipes_come_out_as_whole_lines(sink):
    out, _, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    threads = []
    for source in range(4):
        read_fd, write_fd = os.pipe()
        forwarder.add(read_fd, dest=1, prefix=f"[{source}] ")
        # A line goes out in three writes (what `print` does unbuffered, and more), so a
        # reader that forwarded what it read as it came would cut it.
        pieces = []
        for i in range(200):
            body = f"s{source}l{i}:" + "x" * (3000 + 97 * i % 5000)
            pieces += [body[:10].encode(), body[10:].encode(), b"\n"]
        threads.append(threading.Thread(target=_writer, args=(write_fd, pieces)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    forwarder.close()
    lines = out.read_bytes().decode().splitlines()
    assert len(lines) == 800
    for line in lines:
        match = re.fullmatch(r"\[(\d)\] s(\d)l(\d+):x+", line)
        assert match and match[1] == match[2], line[:80]
        assert len(line) - len(f"[0] s0l{match[3]}:") == 3000 + 97 * int(match[3]) % 5000
    assert len(set(lines)) == 800


def test_a_100_kb_line_written_in_pieces_arrives_whole_and_tagged(sink):
    out, _, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    read_fd, write_fd = os.pipe()
    forwarder.add(read_fd, dest=1, prefix="[7] ")
    line = b"y" * 100_000
    thread = threading.Thread(
        target=_writer, args=(write_fd, [line[:70_000], line[70_000:], b"\n"])
    )
    thread.start()
    thread.join()
    forwarder.close()
    assert out.read_bytes() == b"[7] " + line + b"\n"


def test_stderr_goes_to_its_own_destination_and_the_last_piece_gets_a_newline(sink):
    out, err, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    a_read, a_write = os.pipe()
    b_read, b_write = os.pipe()
    forwarder.add(a_read, dest=1, prefix="[0] ")
    forwarder.add(b_read, dest=2, prefix="[0,stderr] ")
    _writer(a_write, [b"one\ntwo\nno newline at the end"])
    _writer(b_write, [b"Traceback\n  boom\n"])
    forwarder.close()
    assert out.read_bytes() == b"[0] one\n[0] two\n[0] no newline at the end\n"
    assert err.read_bytes() == b"[0,stderr] Traceback\n[0,stderr]   boom\n"


def test_carriage_returns_end_a_line_but_crlf_stays_one_terminator(sink):
    out, _, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    read_fd, write_fd = os.pipe()
    forwarder.add(read_fd, dest=1, prefix="[1] ")
    # A progress bar redraws with "\r"; a "\r" that ends one read may be half of "\r\n".
    _writer(write_fd, [b"\r 10%", b"\r 50%\r", b"\n", b"done\r\n"])
    forwarder.close()
    assert out.read_bytes() == b"[1] \r[1]  10%\r[1]  50%\r\n[1] done\r\n"


def test_the_log_file_gets_the_bytes_unprefixed(sink, tmp_path):
    out, _, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    read_fd, write_fd = os.pipe()
    forwarder.add(read_fd, dest=1, prefix="[2] ", log_path=str(tmp_path / "rank.2.stdout"))
    _writer(write_fd, [b"a\nb", b"c"])
    forwarder.close()
    assert (tmp_path / "rank.2.stdout").read_bytes() == b"a\nbc"
    assert out.read_bytes() == b"[2] a\n[2] bc\n"


def test_a_fifo_with_its_keepalive_is_drained_at_close(sink, tmp_path):
    out, _, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    read_fd, keepalive = make_fifo(str(tmp_path / "fifo"))
    forwarder.add(read_fd, dest=1, keepalive_fd=keepalive)
    # What a rank does: open the path, write, exit; the keepalive end means no EOF.
    with open(tmp_path / "fifo", "wb") as rank:
        rank.write(b"first\nsecond")
    forwarder.close()
    assert out.read_bytes() == b"first\nsecond\n"


def test_a_line_over_the_limit_is_written_in_pieces_instead_of_held(sink, monkeypatch):
    out, _, (out_fd, err_fd) = sink
    monkeypatch.setattr("gossamer.launcher.output.MAX_LINE", 1000)
    forwarder = Forwarder(out_fd, err_fd)
    read_fd, write_fd = os.pipe()
    forwarder.add(read_fd, dest=1, prefix="[5] ")
    os.write(write_fd, b"z" * 5000)
    # The piece shows up before the writer ends the line or closes the pipe.
    for _ in range(1000):
        if out.stat().st_size >= 1000:
            break
        threading.Event().wait(0.01)
    assert out.stat().st_size >= 1000
    os.write(write_fd, b"z" * 10 + b"\nnext\n")
    os.close(write_fd)
    forwarder.close()
    # One prefix for the whole line, however many writes it took.
    assert out.read_bytes() == b"[5] " + b"z" * 5010 + b"\n[5] next\n"
    assert MAX_LINE >= 2**20


def test_a_closed_destination_does_not_stop_the_draining(tmp_path):
    out_read, out_write = os.pipe()
    os.close(out_read)  # `gossamer run ... | head` after head has exited
    err = os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT)
    forwarder = Forwarder(out_write, err)
    read_fd, write_fd = os.pipe()
    forwarder.add(read_fd, dest=1)
    # More than a pipe holds: a forwarder that stopped reading would block this writer.
    thread = threading.Thread(target=_writer, args=(write_fd, [b"w" * 1000 + b"\n"] * 2000))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    forwarder.close()
    os.close(out_write)
    os.close(err)
    assert (tmp_path / "err").read_bytes() == b""  # a broken pipe is not worth a message


def test_a_failure_in_the_forwarder_is_reported_and_the_rank_never_blocks(sink, monkeypatch):
    _, err, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)

    def broken(*args, **kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(forwarder, "_emit", broken)
    read_fd, write_fd = os.pipe()
    forwarder.add(read_fd, dest=1)
    thread = threading.Thread(target=_writer, args=(write_fd, [b"v" * 1000 + b"\n"] * 2000))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    forwarder.close()
    assert "forwarding a rank's output failed: RuntimeError('bug')" in err.read_text()


def test_dest_must_be_stdout_or_stderr(sink):
    _, _, (out_fd, err_fd) = sink
    forwarder = Forwarder(out_fd, err_fd)
    read_fd, write_fd = os.pipe()
    with pytest.raises(ValueError, match="dest must be 1"):
        forwarder.add(read_fd, dest=3)
    forwarder.close()
    os.close(read_fd)
    os.close(write_fd)


# --------------------------------------------------------------------------- real ranks

LINES = textwrap.dedent(r"""
    import os, sys
    rank = int(os.environ["RANK"])
    for i in range(300):
        head = f"rank {rank} line {i} "
        print(head + "o" * (2000 + 37 * i) + " end")
        print(head + "e" * (2000 + 53 * i) + " end", file=sys.stderr)
""")


def _launch(args, tmp_path, **kwargs):
    script = tmp_path / "lines.py"
    script.write_text(LINES)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", *args, str(script)]
    # stdout and stderr are pipes, as in `gossamer run ... | tee log`.
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, **kwargs)


def _check_lines(text, *, letter, prefix):
    counts = collections.Counter()
    pattern = re.compile(rf"{prefix}rank (\d) line (\d+) ({letter}+) end")
    for line in text.splitlines():
        match = pattern.fullmatch(line)
        assert match, f"cut or mixed line: {line[:100]!r}...{line[-40:]!r}"
        rank, i = int(match[1]), int(match[2])
        if prefix:
            assert line.startswith(f"[{rank}"), line[:40]
        assert len(match[3]) == 2000 + (37 if letter == "o" else 53) * i
        counts[rank, i] += 1
    assert counts == {(r, i): 1 for r in range(4) for i in range(300)}


def test_four_ranks_long_lines_into_a_pipe_arrive_whole_and_exactly_once(tmp_path):
    done = _launch(["-np", "4"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    _check_lines(done.stdout, letter="o", prefix="")
    _check_lines(done.stderr, letter="e", prefix="")


def test_tag_output_and_log_dir(tmp_path):
    logs = tmp_path / "logs"
    done = _launch(["-np", "4", "--tag-output", "--log-dir", str(logs)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    _check_lines(done.stdout, letter="o", prefix=r"\[\d\] ")
    _check_lines(done.stderr, letter="e", prefix=r"\[\d,stderr\] ")
    assert sorted(p.name for p in logs.iterdir()) == [
        f"rank.{r}.{s}" for r in range(4) for s in ("stderr", "stdout")
    ]
    for rank in range(4):
        lines = (logs / f"rank.{rank}.stdout").read_text().splitlines()
        assert [line.split(" ")[3] for line in lines] == [str(i) for i in range(300)]
        assert all(line.startswith(f"rank {rank} ") for line in lines)
        assert (logs / f"rank.{rank}.stderr").read_text().count(" end\n") == 300
