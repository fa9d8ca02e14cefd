"""Team sharing through a DVC remote on a real OpenSSH server (127.0.0.1, temporary keys).

Clone A runs the tiny pipeline up to `collect-expert-features` and pushes; clone B (fresh `git
clone`, empty DVC cache) pulls, and its `dvc repro` re-runs only calibration and evaluation. The
calibrated layers of A and B are then equal bit for bit.
"""

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import pytest

from ssh_server import ssh_server
from tiny_project import make_project, run

pytestmark = pytest.mark.slow

DVC = [sys.executable, "-m", "dvc"]
UPSTREAM = {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features"}
# the test-set features and the merged model's scores were not pushed either: computed downstream
DOWNSTREAM = {"collect-test-features", "evaluate-merged", "calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}


def stages_run(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def stages_skipped(output: str) -> set[str]:
    return set(re.findall(r"Stage '([^']+)' didn't change, skipping", output))


def files_moved(output: str, verb: str) -> int:
    match = re.search(rf"(\d+) files? {verb}", output)
    assert match, output
    return int(match.group(1))


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


@pytest.fixture
def server(tmp_path, monkeypatch):
    """sshd on a free local port, and a temporary HOME whose known_hosts trusts its host key."""
    with ssh_server(tmp_path / "sshd") as srv:
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        known_hosts = home / ".ssh" / "known_hosts"
        known_hosts.write_text(srv.known_hosts_line)
        # every dvc subprocess (tiny_project.run copies os.environ) sees this HOME: no user ssh
        # config, keys or DVC global config leak in
        monkeypatch.setenv("HOME", str(home))
        _check_host_key(srv, known_hosts)
        yield srv


def _check_host_key(srv, known_hosts: Path) -> None:
    """The server on the port is ours: it proves the generated host key (strict known_hosts check)."""
    import asyncssh

    async def probe():
        async with asyncssh.connect(srv.host, port=srv.port, username=srv.user, client_keys=[str(srv.keyfile)],
                                    known_hosts=str(known_hosts)) as conn:
            return (await conn.run("true", check=True)).exit_status

    assert asyncio.run(probe()) == 0


def set_keyfile(project: Path, srv) -> None:
    """Credentials go to the untracked .dvc/config.local: each clone sets its own."""
    run(DVC + ["remote", "modify", "--local", "storage", "keyfile", str(srv.keyfile)], project)


def test_push_from_clone_a_pull_into_fresh_clone_b_reruns_only_calibration(tmp_path, server):
    remote_dir = tmp_path / "remote"
    a = make_project(tmp_path)

    # A: the remote goes into the committed .dvc/config; the expensive part of the pipeline is
    # committed to git (dvc.lock, .gitignore files, the uncached metrics) and pushed to the remote
    run(DVC + ["remote", "add", "-d", "storage", server.url(remote_dir)], a)
    set_keyfile(a, server)
    # collect-expert-features does not depend on merge: name both targets
    first = run(DVC + ["repro", "merge", "collect-expert-features"], a)
    assert stages_run(first) == UPSTREAM, first
    layer = a / "features/experts/layer_00.zarr"
    layer_files = [p.relative_to(layer).as_posix() for p in files_under(layer)]
    # one zarr.json for the group, one zarr.json + one shard file per task array
    assert len(layer_files) == 1 + 2 * 2, layer_files
    assert sum(name.endswith("zarr.json") for name in layer_files) == 3, layer_files
    run(["git", "add", "-A"], a)
    run(["git", "commit", "-qm", "experts and expert features"], a)
    started = time.monotonic()
    pushed = run(DVC + ["push"], a)
    push_s = time.monotonic() - started
    n_pushed = files_moved(pushed, "pushed")
    assert n_pushed > 0, pushed
    assert "in sync" in run(DVC + ["status", "--cloud"], a), "remote misses objects after push"
    assert "Accepted publickey" in server.log.read_text()

    # B: fresh clone with its own empty cache; the remote comes with the clone, the key does not
    b = tmp_path / "clone_b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    assert not (b / ".dvc/cache").exists() and not (b / "features/experts").exists()
    assert Path(run(DVC + ["cache", "dir"], b).strip()).resolve() == (b / ".dvc/cache").resolve()
    assert "keyfile" not in (b / ".dvc/config").read_text() and not (b / ".dvc/config.local").exists()
    set_keyfile(b, server)
    # A pushed what it ran: pull those stages and everything upstream of them
    started = time.monotonic()
    pulled = run(DVC + ["pull", "--with-deps", "merge", "collect-expert-features"], b)
    pull_s = time.monotonic() - started
    assert files_moved(pulled, "fetched") == n_pushed, pulled
    assert files_under(b / "features/experts/layer_00.zarr") and (b / "models/merged").is_dir()

    # DVC's own view before and during repro: in the main pipeline only the downstream stages are
    # out of date (compare/dvc.yaml holds optional extra runs, not part of this exchange)
    out = run(DVC + ["status", "--json", "dvc.yaml"], b)
    status = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert set(status) == DOWNSTREAM, status
    second = run(DVC + ["repro"], b)
    assert stages_run(second) == DOWNSTREAM, second
    assert UPSTREAM <= stages_skipped(second), second

    # A calibrates from its own cache; the weights agree bit for bit
    third = run(DVC + ["repro"], a)
    assert stages_run(third) == DOWNSTREAM, third
    layers_a = sorted(p.name for p in (a / "calib/layers").glob("*.safetensors"))
    assert layers_a == ["L00.safetensors", "L01.safetensors"]
    for name in layers_a:
        assert (a / "calib/layers" / name).read_bytes() == (b / "calib/layers" / name).read_bytes(), name

    # shown with `pytest -s`: what one exchange moved (README, "Sharing caches with a team")
    stores = sorted(a.glob("features/experts/*.zarr")) + sorted(a.glob("calib/*/*.zarr"))
    print(f"\nremote exchange: {n_pushed} files pushed in {push_s:.1f}s, pulled in {pull_s:.1f}s; "
          f"{len(files_under(remote_dir))} files on the remote")
    for store in stores:
        print(f"  {store.relative_to(a)}: {len(files_under(store))} files")
