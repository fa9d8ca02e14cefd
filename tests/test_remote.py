"""Team sharing through a DVC remote on a real OpenSSH server (127.0.0.1, temporary keys).

Clone A (a copy of the session's tiny project when it had run up to `collect-expert-features`)
pushes; clone B (fresh `git clone`, empty DVC cache) pulls, and its `dvc repro` re-runs only
calibration and evaluation. The calibrated layers of B and of A's own `dvc repro` (the session's
project, reproduced from that same state) are then equal bit for bit.
"""

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from conftest import DOWNSTREAM, DVC, UPSTREAM, copy_project, stages_run, stages_skipped
from ssh_server import ssh_server
from tiny_project import run

pytestmark = pytest.mark.slow(14)


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


def test_push_from_clone_a_pull_into_fresh_clone_b_reruns_only_calibration(tiny_project, tmp_path, server):
    remote_dir = tmp_path / "remote"
    # A ran `dvc repro merge collect-expert-features` (collect-expert-features does not depend on
    # merge: both targets named)
    a = copy_project(tiny_project.upstream, tmp_path / "project")
    first = tiny_project.upstream_output
    assert stages_run(first) == UPSTREAM, first

    # A: the remote goes into the committed .dvc/config; the expensive part of the pipeline is
    # committed to git (dvc.lock, .gitignore files, the uncached metrics) and pushed to the remote
    run(DVC + ["remote", "add", "-d", "storage", server.url(remote_dir)], a)
    set_keyfile(a, server)
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
    # (the test-set features and the merged model's scores were not pushed either: computed downstream)
    out = run(DVC + ["status", "--json", "dvc.yaml"], b)
    status = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert set(status) == DOWNSTREAM, status
    second = run(DVC + ["repro"], b)
    assert stages_run(second) == DOWNSTREAM, second
    assert UPSTREAM <= stages_skipped(second), second

    # A calibrates from its own cache (the session's project: `dvc repro` after the same upstream
    # run); the weights agree bit for bit
    third = tiny_project.full_output
    assert stages_run(third) == DOWNSTREAM, third
    calibrated_a = tiny_project.full / "calib/layers"
    layers_a = sorted(p.name for p in calibrated_a.glob("*.safetensors"))
    assert layers_a == ["L00.safetensors", "L01.safetensors"]
    for name in layers_a:
        assert (calibrated_a / name).read_bytes() == (b / "calib/layers" / name).read_bytes(), name

    # shown with `pytest -s`: what one exchange moved (README, "Sharing caches with a team")
    stores = sorted(b.glob("features/experts/*.zarr")) + sorted(b.glob("calib/*/*.zarr"))
    print(f"\nremote exchange: {n_pushed} files pushed in {push_s:.1f}s, pulled in {pull_s:.1f}s; "
          f"{len(files_under(remote_dir))} files on the remote")
    for store in stores:
        print(f"  {store.relative_to(b)}: {len(files_under(store))} files")
