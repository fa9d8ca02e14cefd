"""A private PostgreSQL server on 127.0.0.1 for tests: a temporary cluster, stopped and removed on exit.

Needs Debian's `postgresql` (`tests/system_deps.sh` installs it); the package's own service is not
used. initdb refuses to run as root, so under root the cluster belongs to the `postgres` system user
(created by the package) and its commands run through `runuser`. Trust authentication on 127.0.0.1
only, for one database user `featcal`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

USER = "featcal"
DATABASE = "optuna"


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    database: str
    log: Path

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://{self.user}@{self.host}:{self.port}/{self.database}"


def bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if not found:
        raise RuntimeError("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin "
                           "(run `bash tests/system_deps.sh` as root: it installs Debian's postgresql)")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server(timeout: float = 60.0) -> Iterator[PostgresServer]:
    """Start a fresh cluster on a free port; yield it; stop it (fast shutdown) and delete it."""
    bins = bin_dir()
    root = Path(tempfile.mkdtemp(prefix="featcal-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data, log = root / "data", root / "server.log"

    def run(*cmd: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([*prefix, *cmd], capture_output=True, text=True, cwd=root, timeout=timeout)
        if proc.returncode != 0:
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}\n{tail}")
        return proc

    started = False
    try:
        run(str(bins / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8",
            "--locale=C", "--no-sync")
        for attempt in range(5):   # another process may take the free port before the server binds it
            port = _free_port()
            options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=50"
            try:
                run(str(bins / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t",
                    str(int(timeout)), "start")
                started = True
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(0.5)
        run(str(bins / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, DATABASE)
        yield PostgresServer("127.0.0.1", port, USER, DATABASE, log)
    finally:
        if started:
            with contextlib.suppress(Exception):
                run(str(bins / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
