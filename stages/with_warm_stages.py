"""Run one command (`dvc repro`, `dvc exp run ...`) with its DVC stages started warm.

`make repro` and `make exp` run DVC through this script: it starts `stages/warm_start.py serve` on a
private socket, waits until the server has imported torch & co., runs the command with
FEATCAL_WARM_STAGES naming the socket, and stops the server when the command ends. Each stage then
forks from the server instead of spending ~3 s on imports; what it computes is the same
(tests/test_warm_start.py). A server that does not come up costs only the wait: the stages start cold.
A command that runs the `dvc` executable runs it as stages/dvc_main.py (DVC with its YAML work done
once: the same decisions and files), under the interpreter that executable names.

    python stages/with_warm_stages.py dvc exp run -S featcal.alpha=0.5

Not a stage, and no stage's dependency: editing it re-runs nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from warm_start import ENV_KEY

SERVER = Path(__file__).resolve().parent / "warm_start.py"
DVC_MAIN = Path(__file__).resolve().parent / "dvc_main.py"
SOCKET_PATH_MAX = 100   # a Unix socket's path holds at most 107 bytes on Linux


@contextlib.contextmanager
def serving(env: Mapping[str, str] | None = None, ready_s: float = 60.0,
            preload: Sequence[str] = ()) -> Iterator[Path | None]:
    """A warm-start server for the block's duration (started with `env`, default os.environ), its
    socket in a fresh folder only this user can enter. Yields the socket's path once the server
    listens, or None if it did not within `ready_s` (with `ready_s=0` the path at once: stages that
    start before the server is ready wait for it, `warm_start.await_server`). `preload`: modules it
    imports beside the stages' (`warm_start.py serve --preload`)."""
    folder = Path(tempfile.mkdtemp(prefix="featcal-warm-"))
    if len(os.fsencode(folder / "stages.sock")) > SOCKET_PATH_MAX:   # a long TMPDIR
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix="featcal-warm-", dir="/tmp"))
    path = folder / "stages.sock"
    server = subprocess.Popen([sys.executable, str(SERVER), "serve", "--socket", str(path),
                               *(["--preload", *preload] if preload else [])],
                              env=None if env is None else dict(env), stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ready_s
        while not path.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        yield path if ready_s == 0 or path.exists() else None
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def with_dvc_main(command: list[str]) -> list[str]:
    """`dvc ARGS` as `<dvc's interpreter> stages/dvc_main.py ARGS`; any other command as it is, and so
    is a `dvc` whose script does not start with its Python's path."""
    found = shutil.which(command[0]) if command and Path(command[0]).name == "dvc" else None
    if found is None:
        return command
    with open(found, "rb") as script:
        first = script.readline(4096)
    interpreter = first[2:].decode(errors="replace").strip() if first.startswith(b"#!") else ""
    if not Path(interpreter).name.startswith("python") or not os.access(interpreter, os.X_OK):
        return command   # e.g. pip's `#!/bin/sh` wrapper for a long interpreter path
    return [interpreter, str(DVC_MAIN), *command[1:]]


def run_served(command: list[str]) -> int:
    """`command`'s exit status, run with a warm-start server (or under the caller's, if it has one)."""
    command = with_dvc_main(command)
    if os.environ.get(ENV_KEY):
        return subprocess.call(command)
    with serving() as path:
        if path is None:
            print("with_warm_stages: the warm-start server did not come up; the stages start cold", file=sys.stderr)
        env = dict(os.environ) if path is None else dict(os.environ, **{ENV_KEY: str(path)})
        child = subprocess.Popen(command, env=env)
        # Ctrl-C reaches the command itself (same process group), which stops as it sees fit; this
        # process only waits for it. A SIGTERM sent here is passed on.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, _frame: child.send_signal(signum))
        return child.wait()


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        raise SystemExit(2)
    code = run_served(sys.argv[1:])
    raise SystemExit(128 - code if code < 0 else code)   # a signal's death as the shell reports it


if __name__ == "__main__":
    main()
