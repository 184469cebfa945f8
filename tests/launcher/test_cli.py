import re

import pytest

from gossamer.launcher import cli
from gossamer.launcher.hosts import is_local_host, parse_hosts, place


def test_split_stops_at_the_script_and_keeps_its_options():
    ours, cmd = cli._split(["run", "-np", "4", "--verbose", "train.py", "-np", "9", "--lr=1"])
    assert ours == ["run", "-np", "4", "--verbose"]
    assert cmd == ["train.py", "-np", "9", "--lr=1"]


def test_split_recognises_a_module():
    ours, cmd = cli._split(["run", "-np", "2", "-m", "pytest", "-q", "tests/x.py"])
    assert ours == ["run", "-np", "2"]
    assert cmd == ["-m", "pytest", "-q", "tests/x.py"]


@pytest.fixture(autouse=True)
def _scripts_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.py", "train.py"):
        (tmp_path / name).write_text("")


def _plan(argv):
    ours, cmd = cli._split(argv)
    return cli._plan(cli.build_parser().parse_args(ours), cmd)


def test_single_machine_plan_rendezvouses_on_loopback():
    plan = _plan(["run", "-np", "3", "--rdzv-id", "job", "a.py", "x"])
    assert plan.loopback and plan.hosts is None
    assert plan.torchrun == [
        "--nnodes=1",
        "--rdzv-backend=gossamer-loopback",
        "--rdzv-endpoint=127.0.0.1:0",
        "--rdzv-id=job",
        "--nproc-per-node=3",
        "--max-restarts=0",
        "a.py",
        "x",
    ]


@pytest.mark.parametrize("spelling", ["-np", "--np", "--num-proc"])
def test_np_has_the_spellings_of_mpirun_and_horovodrun(spelling):
    assert "--nproc-per-node=2" in _plan(["run", spelling, "2", "a.py"]).torchrun


def test_the_loopback_backend_name_matches_the_module():
    from gossamer.launcher import loopback

    assert f"--rdzv-backend={loopback.BACKEND}" in _plan(["run", "-np", "2", "a.py"]).torchrun


def test_multi_machine_plan_uses_the_rendezvous_endpoint():
    plan = _plan(["run", "-np", "8", "--nnodes", "2", "--rdzv-endpoint", "h:1234", "-m", "m"])
    assert not plan.loopback
    assert plan.torchrun[:4] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:1234",
        "--rdzv-id=gossamer",
    ]
    assert plan.torchrun[4:] == ["--nproc-per-node=4", "--max-restarts=0", "--module", "m"]


def test_a_range_of_machines_goes_to_c10d_and_lets_checkpoints_resize():
    argv = [
        "run",
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        "h:9",
        "--rdzv-conf",
        "last_call_timeout=2",
        "--max-restarts",
        "1",
        "a.py",
    ]
    plan = _plan(argv)
    assert plan.resizable and not plan.loopback
    assert plan.torchrun == [
        "--nnodes=1:3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:9",
        "--rdzv-id=gossamer",
        "--rdzv-conf=last_call_timeout=2",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "a.py",
    ]
    assert not _plan(
        ["run", "-np", "4", "--nnodes", "2:2", "--rdzv-endpoint", "h:9", "a.py"]
    ).resizable


@pytest.mark.parametrize(
    ("nodes", "extra", "words"),
    [
        ("1:2", [], "needs --rdzv-endpoint"),
        ("1:2", ["--rdzv-endpoint", "h:1", "--node-rank", "0"], "cannot take --node-rank"),
        ("1:2", ["--rdzv-endpoint", "h:1", "-np", "2"], "takes --nproc-per-node, not -np"),
        ("1:2", ["--rdzv-endpoint", "h:1", "--elastic"], "--elastic cannot be combined"),
    ],
)
def test_bad_ranges_of_machines_are_refused(nodes, extra, words):
    argv = ["run", "--nnodes", nodes, "--nproc-per-node", "1", *extra, "a.py"]
    with pytest.raises(ValueError, match=words):
        _plan(argv)


@pytest.mark.parametrize("nodes", ["0:2", "3:2", "1:", ":2", "a:b", "1:2:3"])
def test_bad_nnodes_exits_2_and_names_it(nodes, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--nnodes", nodes, "--nproc-per-node", "1", "a.py"])
    assert info.value.code == 2
    assert f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX; got {nodes!r}" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "a.py"], "-np"),
        (["run", "-np", "2"], "no program"),
        (["run", "-np", "2", "-m"], "no program"),
        (["run", "-np", "2", "missing.py"], "script 'missing.py' does not exist"),
        (["run", "-np", "2", "/"], "script '/' is a directory, not a script"),
        (["run", "-np", "3", "--nnodes", "2", "--rdzv-endpoint", "h:1", "a.py"], "divisible"),
        (["run", "-np", "4", "--nnodes", "2", "a.py"], "--rdzv-endpoint"),
        (["run", "-np", "4", "-H", "a:2,b:2", "--nnodes", "2", "a.py"], "cannot be combined"),
        (["run", "-np", "5", "-H", "a:2,b:2", "a.py"], "more than the 4 slots"),
    ],
)
def test_bad_plans_are_refused_with_the_argument_named(argv, words):
    with pytest.raises(ValueError, match=words):
        _plan(argv)


@pytest.mark.parametrize("np_value", ["0", "-1", "two", "1.5"])
def test_bad_np_exits_2_and_names_the_argument(np_value, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "-np", np_value, "a.py"])
    assert info.value.code == 2
    assert "-np" in capsys.readouterr().err


def test_bad_plan_exits_2_before_starting_anything(capsys):
    assert cli.main(["run", "-np", "2", "-H", "host:x", "a.py"]) == 2
    assert "-H/--hosts entry 'host:x'" in capsys.readouterr().err


def test_a_missing_network_interface_exits_2_before_starting_anything(capsys, tmp_path):
    script = tmp_path / "a.py"
    script.write_text("raise SystemExit(5)\n")  # must not run
    assert cli.main(["run", "-np", "2", "--network-interface", "nosuch0", str(script)]) == 2
    err = capsys.readouterr().err
    assert "no interface 'nosuch0' on this machine" in err and "'lo'" in err


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("gossamer ")


def test_parse_hosts():
    assert parse_hosts("h1:4,h2:2") == [("h1", 4), ("h2", 2)]
    assert parse_hosts("h1") == [("h1", 1)]
    assert parse_hosts(" a:1 , b:3 ") == [("a", 1), ("b", 3)]


@pytest.mark.parametrize("bad", ["", "h:0", "h:-1", "h:x", ":2", "a:1,a:2", "a b:1", 5])
def test_parse_hosts_rejects(bad):
    with pytest.raises(ValueError, match="-H/--hosts"):
        parse_hosts(bad)


def test_place_fills_hosts_in_order():
    hosts = [("a", 2), ("b", 2), ("c", 4)]
    assert place(3, hosts) == [("a", 2), ("b", 1)]
    assert place(8, hosts) == [("a", 2), ("b", 2), ("c", 4)]
    with pytest.raises(ValueError, match="-np 9"):
        place(9, hosts)


def test_local_hosts():
    assert is_local_host("localhost") and is_local_host("127.0.0.2")
    assert not is_local_host("node-that-is-elsewhere")


def test_launcher_node_rank_uses_static_rendezvous():
    argv = ["run", "--nnodes", "4", "--node-rank", "2", "--nproc-per-node", "2",
            "--rdzv-endpoint", "10.77.0.1:29511", "a.py", "--x"]  # fmt: skip
    assert _plan(argv).torchrun == [
        "--nnodes=4",
        "--rdzv-backend=static",
        "--master-addr=10.77.0.1",
        "--master-port=29511",
        "--node-rank=2",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "a.py",
        "--x",
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--node-rank", "4", "--rdzv-endpoint", "h:1"], "0..3"),
        (["--node-rank", "-1", "--rdzv-endpoint", "h:1"], "0..3"),
        (["--node-rank", "1", "--rdzv-endpoint", "h"], "host:port"),
    ],
)
def test_launcher_node_rank_errors(extra, message):
    argv = ["run", "--nnodes", "4", "--nproc-per-node", "1", *extra, "a.py"]
    with pytest.raises(ValueError, match=message):
        _plan(argv)


def test_split_knows_that_log_dir_takes_a_value():
    ours, cmd = cli._split(["run", "-np", "2", "--log-dir", "logs", "--tag-output", "a.py", "-v"])
    assert ours == ["run", "-np", "2", "--log-dir", "logs", "--tag-output"]
    assert cmd == ["a.py", "-v"]


def test_log_dir_is_made_absolute_and_created(tmp_path):
    plan = _plan(["run", "-np", "2", "--log-dir", "out/logs", "a.py"])
    assert plan.log_dir == str(tmp_path / "out" / "logs")
    assert (tmp_path / "out" / "logs").is_dir()


def test_a_log_dir_that_is_a_file_exits_2_before_starting_anything(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    assert cli.main(["run", "-np", "2", "--log-dir", "taken", "a.py"]) == 2
    assert f"--log-dir {str(tmp_path / 'taken')!r} cannot be created" in capsys.readouterr().err


def test_hosts_rendezvous_endpoint(monkeypatch):
    from gossamer.launcher import hosts

    all_local = hosts.rendezvous_endpoint([("localhost", 1), ("127.0.0.1", 2)])
    assert all_local.startswith("127.0.0.1:") and all_local.split(":")[1].isdigit()
    assert hosts.rendezvous_endpoint([("node-elsewhere", 2), ("localhost", 1)]) == (
        "node-elsewhere:29400"
    )
    # This machine first, others remote: they cannot reach "localhost"; give them a name.
    monkeypatch.setattr(hosts.socket, "getfqdn", lambda: "this-machine.example")
    mixed = hosts.rendezvous_endpoint([("localhost", 1), ("node-elsewhere", 1)])
    assert mixed.startswith("this-machine.example:")


def test_the_hidden_agent_flag_parses_but_is_not_in_the_help():
    args = cli.build_parser().parse_args(["run", "-np", "1", "--hosts-agent", "--tag-output"])
    assert args.hosts_agent and args.tag_output
    run = cli.build_parser()._subparsers._group_actions[0].choices["run"]
    assert "--hosts-agent" not in run.format_help()
    assert "--tag-output" in run.format_help() and "--log-dir" in run.format_help()


def test_fault_options_reach_torchrun():
    plan = _plan(["run", "-np", "2", "--elastic", "--max-restarts", "3", "a.py"])
    assert "--max-restarts=3" in plan.torchrun


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--min-ranks", "2"], "--min-ranks needs --elastic"),
        (["--checkpoint-dir", "ck"], "--checkpoint-dir and --checkpoint-every go together"),
        (["--checkpoint-every", "5"], "--checkpoint-dir and --checkpoint-every go together"),
        (["-H", "localhost:2", "--max-restarts", "1"], "--max-restarts needs the c10d"),
        (
            ["--checkpoint-dir", __file__, "--checkpoint-every", "3"],
            "exists and is not a directory",
        ),
    ],
)
def test_bad_fault_options_are_refused(argv, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        _plan(["run", "-np", "2", *argv, "a.py"])


@pytest.mark.parametrize("value", ["-1", "x"])
def test_bad_max_restarts_exits_2(value, capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "-np", "2", "--max-restarts", value, "a.py"])
    assert "--max-restarts must be an integer >= 0" in capsys.readouterr().err
