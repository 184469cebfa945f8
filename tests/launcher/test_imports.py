"""The launcher starts without torch or gossamer's runtime, and leaves no distributed state."""

import json
import subprocess
import sys
import textwrap

# What the launcher may import of gossamer: itself, the root package (Python imports a
# package's parents first; it is lazy) and the two leaves.
ALLOWED = {"gossamer", "gossamer.env", "gossamer.errors"}


def _python(code, tmp_path, *args):
    done = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _gossamer_modules(modules):
    return {m for m in modules if m == "gossamer" or m.startswith("gossamer.")}


def test_importing_the_command_line_and_refusing_bad_options_imports_no_torch(tmp_path):
    done = _python(
        """
        import json, sys
        import gossamer.launcher.cli as cli
        from gossamer.launcher import main
        assert cli.main(["--version"]) == 0
        assert cli.main(["run", "-np", "2", "missing.py"]) == 2
        try:
            cli.main(["run", "-np", "0", "x.py"])
        except SystemExit as exit:
            assert exit.code == 2
        print(json.dumps(sorted(sys.modules)))
        """,
        tmp_path,
    )
    modules = json.loads(done.stdout.splitlines()[-1])
    assert "torch" not in modules
    assert not any(m.startswith("numpy") for m in modules)
    launcher = {m for m in modules if m.startswith("gossamer.launcher")}
    assert {"gossamer.launcher.cli", "gossamer.launcher.hosts"} <= launcher
    assert "gossamer.launcher.agent" not in launcher  # the torch side, loaded per job
    assert _gossamer_modules(modules) - launcher <= ALLOWED


def test_python_dash_m_gossamer_launcher_imports_no_torch(tmp_path):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gossamer.launcher", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gossamer ")
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "gossamer.launcher.cli" in imported  # the importtime lines are really there
    assert "torch" not in imported
    assert _gossamer_modules(imported) - {m for m in imported if "launcher" in m} <= ALLOWED


def test_a_launch_leaves_the_launcher_without_process_group_or_runtime(tmp_path):
    (tmp_path / "job.py").write_text(
        "import gossamer\ngossamer.init()\nprint('size', gossamer.size())\ngossamer.shutdown()\n"
    )
    done = _python(
        """
        import json, sys
        from gossamer.launcher import cli
        code = cli.main(["run", "-np", "2", "job.py"])
        import torch.distributed as dist
        print(json.dumps([code, dist.is_initialized(), sorted(sys.modules)]))
        """,
        tmp_path,
    )
    assert done.stdout.count("size 2") == 2
    code, initialized, modules = json.loads(done.stdout.splitlines()[-1])
    assert code == 0
    assert initialized is False
    assert "gossamer.context" not in modules
    launcher = {m for m in modules if m.startswith("gossamer.launcher")}
    assert _gossamer_modules(modules) - launcher <= ALLOWED


def test_the_root_package_is_lazy_and_keeps_every_public_name(tmp_path):
    done = _python(
        """
        import sys
        import gossamer
        assert "gossamer.context" not in sys.modules and "torch" not in sys.modules
        assert gossamer.__version__
        for name in gossamer.__all__:
            getattr(gossamer, name)
        assert set(gossamer.__all__) <= set(dir(gossamer))
        assert {"optim", "topology", "launcher", "windows"} <= set(dir(gossamer))
        assert gossamer.init is sys.modules["gossamer.context"].init
        assert gossamer.topology.ring(4).size == 4
        assert gossamer.optim.__name__ == "gossamer.optim"
        from gossamer import Window, neighbor_allreduce, context
        try:
            gossamer.no_such_name
        except AttributeError as err:
            assert "no_such_name" in str(err)
        else:
            raise AssertionError("no AttributeError")
        print("ok")
        """,
        tmp_path,
    )
    assert done.stdout.strip() == "ok"
