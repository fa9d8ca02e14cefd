"""stages/warm_start.py: a stage forked from a warm interpreter behaves as `python <script>` would
(argv, working directory, environment, standard streams, exit status, signals), and without a
usable server it runs cold."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import warm_start, with_warm_stages
from tiny_project import ROOT

PROBE = '''
import json, os, sys, time
warm = "torch" in sys.modules           # imported before this line only in a warm interpreter
from warm_start import start_stage
start_stage()
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"warm": warm, "argv": sys.argv, "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                      "stdin": sys.stdin.read(), "child": os.environ.get("FEATCAL_WARM_CHILD"), "pid": os.getpid()}))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "where":
    print(json.dumps({"warm": warm}))
    sys.exit(0)
if mode == "nested":   # a stage that starts another
    import subprocess
    sys.exit(subprocess.run([sys.executable, "-u", "stages/probe.py", "report"]).returncode)
if mode == "raise":
    raise ValueError("boom")
if mode == "message":
    sys.exit("a message")
if mode == "sleep":
    print(os.getpid(), flush=True)
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory, warm_stage_starts):
    """A warm server (the session's, conftest.pytest_configure, or one of its own when the session
    runs cold) and a stages folder holding warm_start.py and a probe script."""
    root = tmp_path_factory.mktemp("warm")
    stages = root / "stages"
    stages.mkdir()
    shutil.copy(ROOT / "stages/warm_start.py", stages / "warm_start.py")
    (stages / "probe.py").write_text(PROBE)
    if warm_stage_starts is not None:
        warm_start.await_server(warm_stage_starts)
        assert Path(warm_stage_starts).exists(), "the session's server did not come up in 120 s"
        yield root, Path(warm_stage_starts)
        return
    with with_warm_stages.serving(dict(os.environ), ready_s=120) as sock:
        assert sock is not None, "the server did not come up in 120 s"
        yield root, sock


def probe(root: Path, sock: Path | None, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PROBE="value", **env)
    environment.pop("FEATCAL_WARM_STAGES", None)
    if sock is not None:
        environment["FEATCAL_WARM_STAGES"] = str(sock)
    return subprocess.run([sys.executable, "stages/probe.py", *args], cwd=root, env=environment, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_a_served_stage_gets_argv_cwd_environment_streams_and_its_exit_status(server):
    root, sock = server
    done = probe(root, sock, "report", "--flag", stdin="from stdin")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["warm"] is True   # ran in the server's fork
    assert report["argv"] == ["stages/probe.py", "report", "--flag"]
    assert report["cwd"] == str(root) and report["probe"] == "value" and report["stdin"] == "from stdin"
    assert report["child"] == str(report["pid"])   # it knows it is served: it does not ask again
    assert done.stderr == "to stderr\n"


@pytest.mark.slow(7)
def test_a_command_under_with_warm_stages_has_its_stages_served_and_exits_with_their_status(server):
    """stages/with_warm_stages.py, which `make repro` and `make exp` run DVC under: a server of its own
    for the command's stages, their exit status passed on, nothing left behind."""
    root, _ = server
    folder = Path(tempfile.mkdtemp(prefix="tmp-", dir="/tmp"))   # TMPDIR for the server's folder (short: a socket path)
    environment = dict(os.environ, PROBE="value", TMPDIR=str(folder))
    environment.pop("FEATCAL_WARM_STAGES", None)
    try:
        done = subprocess.run([sys.executable, str(ROOT / "stages/with_warm_stages.py"), sys.executable,
                               "stages/probe.py", "report"], cwd=root, env=environment, input="", capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 3, done.stderr
        report = json.loads(done.stdout)
        assert report["warm"] is True and report["child"] == str(report["pid"])
        assert list(folder.iterdir()) == []   # the server stopped and its socket folder is gone
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_script_outside_the_stages_is_served_through_hand_over_as_the_tests_dvc_commands_are(server, tmp_path,
                                                                                                 warm_stage_starts):
    """tests/dvc_served.py (the tests' `DVC`) hands itself over as a stage does; the session's server
    has DVC imported for it (conftest's DVC_PRELOAD)."""
    root, sock = server
    script = tmp_path / "outside.py"
    script.write_text(f"""
import json, os, sys
sys.path.insert(0, {str(root / "stages")!r})
import warm_start
warm_start.hand_over(__file__)
print(json.dumps({{"warm": "torch" in sys.modules, "dvc": "dvc.repo" in sys.modules, "argv": sys.argv[1:]}}))
""")
    environment = dict(os.environ, FEATCAL_WARM_STAGES=str(sock))
    done = subprocess.run([sys.executable, str(script), "status"], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["warm"] is True and report["argv"] == ["status"], report
    if warm_stage_starts is not None:
        assert report["dvc"] is True, report


def test_a_process_that_a_served_stage_starts_is_served_too(server):
    """As torchrun's workers (`python -u <script>`), started by a stage that became torchrun."""
    root, sock = server
    done = probe(root, sock, "nested")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["warm"] is True and report["child"] == str(report["pid"])


def test_without_a_server_or_with_another_import_time_environment_a_stage_runs_cold(server, tmp_path):
    root, sock = server
    for done in (probe(root, tmp_path / "none.sock", "report"), probe(root, sock, "report", HF_HOME=str(tmp_path))):
        assert done.returncode == 3, done.stderr
        report = json.loads(done.stdout)
        assert report["warm"] is False and report["probe"] == "value"


def test_a_stage_that_starts_while_the_server_imports_waits_for_it_unless_that_server_died(server, tmp_path):
    """The tests' first stages start with the server: they wait for its socket (named here by a link
    to the running one, made while the stage waits) instead of importing torch & co. again, cold."""
    root, sock = server
    path = tmp_path / "starting.sock"
    importing = subprocess.Popen(["sleep", "60"])   # stands for a server still importing
    try:
        warm_start.starting_mark(str(path)).write_text(str(importing.pid))
        environment = dict(os.environ, FEATCAL_WARM_STAGES=str(path))
        stage = subprocess.Popen([sys.executable, "stages/probe.py", "where"], cwd=root, env=environment,
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert stage.poll() is None   # still waiting: no socket yet
        path.symlink_to(sock)         # the socket appears
        assert json.loads(stage.communicate(timeout=120)[0]) == {"warm": True}
    finally:
        importing.kill()
        importing.wait()
    path.unlink()                     # the mark names a server that has died: no wait, a cold start
    done = probe(root, path, "where")
    assert done.returncode == 0 and json.loads(done.stdout) == {"warm": False}, done.stderr


def test_a_stage_with_a_closed_standard_stream_runs_cold(server):
    root, sock = server
    environment = dict(os.environ, FEATCAL_WARM_STAGES=str(sock))
    done = subprocess.run([sys.executable, "stages/probe.py", "where"], cwd=root, env=environment, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.close(0))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"warm": False}


def test_a_served_stage_that_fails_reports_as_python_does(server):
    root, sock = server
    raised = probe(root, sock, "raise")
    assert raised.returncode == 1
    assert "Traceback" in raised.stderr and "ValueError: boom" in raised.stderr
    message = probe(root, sock, "message")
    assert (message.returncode, message.stderr) == (1, "a message\n")


def test_a_signal_to_the_stage_process_reaches_the_served_child(server):
    root, sock = server
    environment = dict(os.environ, FEATCAL_WARM_STAGES=str(sock))
    proc = subprocess.Popen([sys.executable, "stages/probe.py", "sleep"], cwd=root, env=environment,
                            stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists():
        assert time.monotonic() < deadline, "the child outlived the signal"
        time.sleep(0.05)


def test_a_plain_dvc_repro_stage_refreshes_its_bars_as_make_does():
    """A stage run cold by a plain `dvc repro` (no Makefile, stderr captured to a log) sets tqdm's
    intervals itself before tqdm is imported: 30 s into a log, as under make; the user's own win."""
    probe = ("import sys; sys.path.insert(0, 'stages'); import warm_start; warm_start.set_stage_defaults(); "
             "from tqdm.auto import tqdm; bar = tqdm(total=1); print(bar.mininterval, bar.maxinterval)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["30.0", "30.0"], done.stdout + done.stderr
    mine = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**env, "TQDM_MININTERVAL": "2"},
                          capture_output=True, text=True, timeout=60)
    assert mine.stdout.split()[0] == "2.0"
