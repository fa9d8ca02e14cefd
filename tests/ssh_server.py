"""A private OpenSSH server on 127.0.0.1 for tests: temporary host and user keys, stopped on exit.

Needs Debian's `openssh-server` (`tests/system_deps.sh` installs it). The login user is whoever runs
the tests; the only way in is the generated user key (no passwords, no PAM).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SSHD = Path("/usr/sbin/sshd")
SSH_KEYGEN = "ssh-keygen"
PRIVSEP_DIR = Path("/run/sshd")


@dataclass(frozen=True)
class SSHServer:
    host: str
    port: int
    user: str
    keyfile: Path          # private user key accepted by the server
    host_key: str          # server public host key, "ssh-ed25519 AAAA..."
    log: Path

    @property
    def known_hosts_line(self) -> str:
        return f"[{self.host}]:{self.port} {self.host_key}\n"

    def url(self, path: str | os.PathLike) -> str:
        return f"ssh://{self.user}@{self.host}:{self.port}{Path(path).resolve()}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "featcal-test", "-f", str(path)],
                   check=True, capture_output=True)
    return " ".join(path.with_name(path.name + ".pub").read_text().split()[:2])


def _wait_for_port(proc: subprocess.Popen, port: int, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            # sshd greets first: an SSH banner means it is really serving, not just bound
            s.settimeout(2.0)
            if s.recv(64).startswith(b"SSH-"):
                return
        time.sleep(0.1)
    raise RuntimeError(f"sshd did not accept connections on port {port} within {timeout}s:\n{log.read_text()[-4000:]}")


def _children(pid: int) -> list[int]:
    """Descendants of pid (Linux /proc), deepest last."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


@contextlib.contextmanager
def ssh_server(workdir: Path) -> Iterator[SSHServer]:
    """Start sshd in the foreground on a free local port; always stopped (with its children) on exit."""
    if not SSHD.exists():
        raise RuntimeError(f"{SSHD} missing: run `bash tests/system_deps.sh` (installs Debian openssh-server)")
    if not PRIVSEP_DIR.is_dir():
        try:
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True)
        except OSError as exc:
            raise RuntimeError(f"sshd needs its privilege-separation directory {PRIVSEP_DIR}: {exc}") from exc
    workdir.mkdir(parents=True, exist_ok=True)
    host_key_file, user_key = workdir / "host_ed25519", workdir / "user_ed25519"
    host_key = _keygen(host_key_file)
    user_pub = _keygen(user_key)
    authorized = workdir / "authorized_keys"
    authorized.write_text(user_pub + "\n")
    authorized.chmod(0o600)
    port, log, pidfile = _free_port(), workdir / "sshd.log", workdir / "sshd.pid"
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {host_key_file}",
        f"PidFile {pidfile}",
        f"AuthorizedKeysFile {authorized}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",   # CI runs as root
        "StrictModes no",                      # keys live in a world-readable temp dir
        "UsePAM no",
        "UseDNS no",
        "MaxSessions 32",
        "Subsystem sftp internal-sftp",        # no dependency on the sftp-server binary's path
        "LogLevel VERBOSE",
        "",
    ]))
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log_fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_port(proc, port, log)
        yield SSHServer("127.0.0.1", port, getpass.getuser(), user_key, host_key, log)
    finally:
        # per-connection sshd children call setsid(): find them before the listener goes
        children = _children(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
