"""Warm stage starts: stage processes forked from an interpreter that has imported torch already.

A stage process spends ~2.5 s importing torch, transformers, zarr and pyarrow before it works; on a
small project that is most of `dvc repro`. `python stages/warm_start.py serve --socket PATH` imports
them once and waits; a stage started with FEATCAL_WARM_STAGES=PATH in its environment (checked by
`start_stage`, every stage script's first call) hands its argv, working directory, environment and
standard streams to that server, which forks a child to run the script as `python` would, and exits
with the child's status. Signals sent to the stage process reach the child. A stage that starts while
the server is still importing waits for it (`await_server`). Without a server, or
when the server cannot stand in (another interpreter, or environment variables read at import time
differ), the stage runs as usual. Nothing of the project (featcal, stages) is imported by the
server, so each stage imports the project's code afresh. Whoever can open the socket runs code as
its owner: keep it in a folder only you can enter (as tests/conftest.py does).

`make repro` and `make exp` run DVC this way (stages/with_warm_stages.py), and so does the test suite
(tests/conftest.py), whose DVC commands themselves are served too (`hand_over`, tests/dvc_served.py).
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import importlib
import io
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Sequence

ENV_KEY = "FEATCAL_WARM_STAGES"
# Third-party modules the stages import (and the families' model code); the project's own code is never
# preloaded.
PRELOAD = ("numpy", "yaml", "torch", "torch.nn.functional", "safetensors.torch", "transformers",
           "transformers.modeling_utils", "transformers.models.bert.modeling_bert", "zarr", "pyarrow.parquet",
           "pandas", "tqdm", "optuna", "matplotlib.pyplot", "pydantic", "pydantic.types", "tabulate",
           "sqlalchemy", "sqlalchemy.orm",
           *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "mistral", "t5", "vit", "clip", "mpnet")))

# Environment variables read when those modules are imported: a stage whose values differ runs cold.
IMPORT_TIME_PREFIXES = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_",
                        "CUDA_", "PYTHON", "ZARR_", "NUMPY_", "ARROW_", "MPL", "TQDM_")
# ...except what torchrun sets for its workers, read when the process group starts, not at import.
RUNTIME_ONLY_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
CHILD_KEY = "FEATCAL_WARM_CHILD"   # the pid of a served stage: it runs where it is, never asks again
# What every stage process sets before importing anything (start_stage).
# (HF_HUB_DISABLE_PROGRESS_BARS: no per-load bars from transformers.)
STAGE_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
STAGES_DIR = Path(__file__).resolve().parent
_MAX_HEADER = 16 << 20


def progress_defaults(terminal: bool) -> dict[str, str]:
    """tqdm's refresh intervals (read when tqdm is imported): in place on a terminal; into a file or a
    log (CI, a plain `dvc repro`'s captured output) at most every 30 s, so a bar is a few lines, not
    one per step. The Makefile sets the same."""
    return {"TQDM_MININTERVAL": "0.1", "TQDM_MAXINTERVAL": "10"} if terminal else \
        {"TQDM_MININTERVAL": "30", "TQDM_MAXINTERVAL": "30"}


def set_stage_defaults() -> None:
    terminal = bool(sys.__stderr__) and sys.__stderr__.isatty()
    for key, value in {**STAGE_ENV_DEFAULTS, **progress_defaults(terminal)}.items():
        os.environ.setdefault(key, value)


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(RUNTIME_ONLY_PREFIXES)}


# --- the stage's side ------------------------------------------------------------------------------


def start_stage() -> None:
    """Every stage script's first call (through stages/common.py): set the stage environment's
    defaults; then, when a warm interpreter serves this script, run it there and exit with its
    status; otherwise return and let the stage import and run here."""
    set_stage_defaults()
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if not script or Path(script).resolve().parent != STAGES_DIR:
        return   # not a stage script run as `python stages/<name>.py` (tests and benchmarks import common)
    hand_over(script)


def hand_over(script: str) -> None:
    """Run this process's script (`script`, with sys.argv) in the server FEATCAL_WARM_STAGES names and exit with
    its status; return if there is none, if this is the served child itself, or if the server cannot
    take it (refused), to run here as usual."""
    path = os.environ.get(ENV_KEY)
    if not path or os.environ.get(CHILD_KEY) == str(os.getpid()):
        return   # no server, or this is the served child itself
    if None in (sys.__stdin__, sys.__stdout__, sys.__stderr__):
        return   # started with a standard stream closed: its fd may name another file now
    await_server(path)
    request = {"argv": sys.argv, "script": str(Path(script).resolve()), "cwd": os.getcwd(),
               "env": dict(os.environ), "executable": os.path.realpath(sys.executable),
               # `python -u` (torchrun starts its workers so) writes through
               "unbuffered": bool(getattr(sys.__stdout__, "write_through", False))}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:   # until the server has started the child, anything amiss means a cold start here
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        replies = conn.makefile("r")
        first = json.loads(replies.readline() or '{"refused": "the server closed the connection"}')
    except (OSError, ValueError):
        conn.close()
        return
    with conn:
        if "refused" in first:
            return
        child = int(first["pid"])
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: _forward(child, signum))
        line = replies.readline()
    code = int(json.loads(line)["exit"]) if line else 1
    if code < 0:   # the child died of a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def starting_mark(path: str) -> Path:
    """Beside the socket while the server imports: its pid (the socket itself appears when it is done)."""
    return Path(f"{path}.starting")


def await_server(path: str, timeout_s: float = 120.0) -> None:
    """A server that is still importing: wait for its socket rather than make the same imports here,
    cold, on the same CPU (stages that start with the server, as the tests' first ones do). Returns
    at once when no server is starting, or when it has died."""
    mark = starting_mark(path)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        try:
            os.kill(int(mark.read_text()), 0)
        except PermissionError:   # alive, another user's: it is still starting
            pass
        except (OSError, ValueError):   # no mark (no server starting), or its server has died
            return
        time.sleep(0.05)


def _forward(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):   # it may have ended meanwhile
        os.kill(pid, signum)


# --- the server's side -----------------------------------------------------------------------------


def _warm_caches() -> None:
    """Caches the stages fill on their first model load, filled once here: transformers compiles its
    ~900 checkpoint-renaming patterns the first time it is asked for one architecture's (~0.1 s)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    get_checkpoint_conversion_mapping("bert")


def serve(path: str, preload: Sequence[str] = ()) -> None:
    """Import PRELOAD and `preload`, then fork a handler per connection until terminated."""
    set_stage_defaults()
    mark = starting_mark(path)
    mark_tmp = mark.with_name(f"{mark.name}.{os.getpid()}.tmp")
    mark_tmp.write_text(str(os.getpid()))
    os.replace(mark_tmp, mark)
    try:
        _serve(path, (*PRELOAD, *preload))
    finally:
        mark.unlink(missing_ok=True)


def _serve(path: str, preload: Sequence[str]) -> None:
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    _warm_caches()
    frozen = import_time_env(before)
    # what the imports themselves set (torch: TORCHINDUCTOR_CACHE_DIR), as they would in the stage; a
    # stage started by a process that made those imports (torchrun's workers) has them already
    added = {k: v for k, v in os.environ.items() if k not in before}
    # A fork copies only the forking thread, so no Python thread may hold a lock meanwhile. (Native
    # pools, OpenBLAS's and Arrow's, handle forks, as they do for torch's DataLoader workers.)
    if threading.active_count() != 1:
        raise SystemExit(f"warm_start: Python threads after the imports: {threading.enumerate()}; not forking from them")
    tmp = f"{path}.{os.getpid()}.tmp"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(tmp)
    os.replace(tmp, path)   # the socket appears only once the imports are done
    starting_mark(path).unlink(missing_ok=True)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # handlers are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            conn, _ = server.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    _handle(conn, frozen, added)
                finally:
                    os._exit(0)
            conn.close()
    finally:
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            raise ConnectionError("the stage closed the connection")
        data, fds = data + chunk, fds + list(more)
        if len(data) > _MAX_HEADER:
            raise ConnectionError("request too large")
    return json.loads(data), fds


def _handle(conn: socket.socket, frozen: dict[str, str], added: dict[str, str]) -> None:
    """One stage: check the request, fork the child that runs it, report its pid and its status."""
    request, fds = _receive(conn)
    reason = None
    if request["executable"] != os.path.realpath(sys.executable):
        reason = f"another interpreter ({request['executable']})"
    elif (theirs := import_time_env({k: v for k, v in request["env"].items() if added.get(k) != v})) != frozen:
        differ = sorted(k for k in set(theirs) | set(frozen) if theirs.get(k) != frozen.get(k))
        reason = f"environment variables read at import time differ: {', '.join(differ)}"
    elif len(fds) != 3:
        reason = "standard streams not received"
    if reason is not None:
        print(f"warm_start: {request['argv'][0]} starts cold: {reason}", file=sys.stderr, flush=True)
        conn.sendall(json.dumps({"refused": reason}).encode() + b"\n")
        return
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_stage(request, fds, added)   # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _stream(fd: int, mode: str, env: dict[str, str], unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream as a fresh interpreter would open it on `fd` (`unbuffered`: `python -u`)."""
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    interactive = os.isatty(fd)
    binary = open(fd, mode + "b", buffering=0 if unbuffered and mode == "w" else -1, closefd=False)
    encoding = (env.get("PYTHONIOENCODING") or "utf-8").split(":")[0] or "utf-8"
    return io.TextIOWrapper(binary, encoding=encoding,
                            errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=mode == "w" and (interactive or fd == 2),
                            write_through=unbuffered and mode == "w")


def _run_stage(request: dict, fds: list[int], added: dict[str, str]) -> None:
    """In the forked child: become `python <script> <args>` in the stage's directory and environment."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
        env = {**added, **request["env"]}
        env[CHILD_KEY] = str(os.getpid())   # processes it starts (torchrun's workers) may be served too
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        unbuffered = bool(request.get("unbuffered"))
        sys.stdin, sys.stdout, sys.stderr = (_stream(0, "r", env, unbuffered), _stream(1, "w", env, unbuffered),
                                             _stream(2, "w", env, unbuffered))
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        sys.argv = list(request["argv"])
        sys.path[0] = str(Path(request["script"]).parent)
        random.seed()   # fresh entropy, as a new interpreter has (torch's default seed is fixed anyway)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        importlib.invalidate_caches()   # files written since the server listed their folders
        try:
            _exec_main(request["script"])
            code = 0
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:   # as the interpreter would: the traceback on stderr, status 1
            traceback.print_exc()
            code = 1
        threading._shutdown()   # what the interpreter does at exit: join non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def _exec_main(script: str) -> None:
    """Run a script as the `__main__` module, sys.argv untouched (runpy would rewrite argv[0])."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=script, __builtins__=builtins, __cached__=None, __loader__=None,
                           __spec__=None, __package__=None)
    sys.modules["__main__"] = module
    exec(compile(Path(script).read_bytes(), script, "exec"), module.__dict__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve", help="import torch & co. once and serve stage starts on a Unix socket")
    run.add_argument("--socket", required=True,
                     help=f"the socket's path, in a folder only you can enter (stages find it in ${ENV_KEY})")
    run.add_argument("--preload", nargs="*", default=[], metavar="MODULE",
                     help="more modules to import beside the stages' (the tests' DVC commands: dvc.cli, ...)")
    args = parser.parse_args()
    serve(args.socket, args.preload)


if __name__ == "__main__":
    main()
