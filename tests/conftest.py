"""What the tests share: the offline environment, one torch thread, the tiny BERT factories, and
one tiny DVC project reproduced once per session.

Helpers are plain functions (`from conftest import tiny_bert, perturbed, ...`); the tiny project is
the session fixture `tiny_project`, which tests never modify: `copy_project` gives each test module
its own copy (work tree, git history and DVC cache) to change. The project builds in the background
while the other tests run (the tests that use it run last); FEATCAL_TESTS_SERIAL=1 builds it in
the foreground instead. Under pytest-xdist (`make test` runs two workers) the first worker to start
builds it and the others wait for that one build (`SharedBuild`). Every DVC stage the tests run
forks from one server that has imported torch and transformers once (`pytest_configure`,
stages/warm_start.py), and so does every DVC command they run (`DVC`, tests/dvc_served.py: the
server has imported DVC too); FEATCAL_TESTS_COLD=1 starts each stage cold instead, as `make repro` does.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import json
import threading
import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace


def _load_stage_helper(name: str):
    """stages/<name>.py, imported by path: stages/ stays off sys.path, so the stage modules
    (whose import starts a stage) stay unimported."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / f"stages/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


warm_start = _load_stage_helper("warm_start")
with_warm_stages = _load_stage_helper("with_warm_stages")   # imports warm_start by name: load it first
# The stage environment's defaults (offline hub, ...) here too, before transformers is imported: a
# warm server started from this process then matches what every stage sets for itself. The tests
# never reach a hub, whatever the caller's environment says (and their stages get the same value,
# tiny_project.project_env, so they match the server).
os.environ["HF_HUB_OFFLINE"] = "1"
warm_start.set_stage_defaults()
# Tiny models gain nothing from intra-op threads and, on a shared machine, threads spin against each
# other: one thread here and in every subprocess (DVC stages, torchrun workers, tune workers).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DVC's usage statistics: each dvc command would spawn a detached process that imports DVC again
# and fails to reach the network (~0.7 s of CPU each, ~140 commands). The project's own .dvc/config
# turns them off; the tests' fresh `dvc init` projects are told by the environment.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import yaml  # noqa: E402

# torch, transformers and tests/tiny_project.py are imported where they are used: under xdist the
# controller process loads this file too, and importing them here held back every worker ~4 s.

from dvc_served import DVC, DVC_PRELOAD  # noqa: E402  (`python -m dvc`, served warm)


# --- warm stage starts ----------------------------------------------------------------------------------

# FEATCAL_TESTS_COLD=1: every DVC stage process imports torch & co. itself, as under a plain `dvc repro`.
COLD = os.environ.get("FEATCAL_TESTS_COLD", "") not in ("", "0")
WARM_ENV_KEY = warm_start.ENV_KEY


def pytest_configure(config):
    """One stages/warm_start.py server for the whole session: the suite's DVC stages fork from it
    instead of each importing torch and transformers (~2.5 s a stage, ~90 stages). It starts before
    collection, in the first pytest process (under xdist the controller, whose workers inherit its
    environment), and its socket goes into os.environ, so every subprocess (dvc, and the stages dvc
    runs) finds it. A stage that starts while the server still imports waits for it; one whose
    environment differs starts cold."""
    if COLD or WARM_ENV_KEY in os.environ or hasattr(config, "workerinput"):
        return
    stack = contextlib.ExitStack()
    # ready_s=0: collection and the first tests go on while the server imports
    path = stack.enter_context(with_warm_stages.serving(dict(os.environ), ready_s=0, preload=DVC_PRELOAD))
    os.environ[WARM_ENV_KEY] = str(path)
    stack.callback(os.environ.pop, WARM_ENV_KEY, None)
    config.add_cleanup(stack.close)


@pytest.fixture(autouse=True, scope="session")
def warm_stage_starts():
    """The session's warm-start socket (pytest_configure), or None when stages start cold."""
    return os.environ.get(WARM_ENV_KEY)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread for the whole session (a test that changes it gets it back)."""
    import torch
    torch.set_num_threads(1)
    yield


# --- tiny models ----------------------------------------------------------------------------------------


def tiny_bert(seed: int = 0, layers: int = 2, *, vocab: int = 60, hidden: int = 24, intermediate: int = 48,
              positions: int = 32, num_labels: int = 2, dtype: torch.dtype | None = None,
              **config) -> BertForSequenceClassification:
    """A seeded random BERT sequence classifier (4 heads), in eval mode; `config`: more BertConfig keys."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=intermediate, num_labels=num_labels, max_position_embeddings=positions, **config)
    model = BertForSequenceClassification(cfg).eval()
    return model if dtype is None else model.to(dtype)


def tiny_mpnet(seed: int = 0, layers: int = 2, *, vocab: int = 60, hidden: int = 24, num_labels: int = 2):
    """A seeded random MPNet sequence classifier (4 heads, pad 1 as the real one's), in eval mode. Its
    relative position table has the 32 buckets the encoder always asks for."""
    import torch
    from transformers import MPNetConfig, MPNetForSequenceClassification
    torch.manual_seed(seed)
    cfg = MPNetConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=2 * hidden, max_position_embeddings=32, num_labels=num_labels)
    return MPNetForSequenceClassification(cfg).eval()


def tiny_causal_lm(model_type: str, seed: int = 0, layers: int = 2, *, vocab: int = 60, hidden: int = 24):
    """A seeded random Llama-like causal LM ('llama', 'qwen2' or 'mistral'): grouped-query attention
    (4 heads, 2 key/value heads), tied embeddings, pad 0; Mistral with a 4-token sliding window."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    extra = {"sliding_window": 4} if model_type == "mistral" else {}
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden,
                               max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=True, **extra)
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_t5(seed: int = 0, encoder_layers: int = 2, decoder_layers: int = 2, *, vocab: int = 60,
            num_labels: int = 2) -> T5ForSequenceClassification:
    """A seeded random T5 sequence classifier (pad 0, EOS 1, the decoder starting from 0), in eval mode."""
    import torch
    from transformers import T5Config, T5ForSequenceClassification
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab, d_model=16, d_kv=4, d_ff=32, num_layers=encoder_layers,
                   num_decoder_layers=decoder_layers, num_heads=4, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, num_labels=num_labels, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1)
    return T5ForSequenceClassification(cfg).eval()


def with_eos(batches: dict, eos: int = 1) -> dict:
    """`batches_for`'s batches with `eos` as each row's last real token, and nowhere else."""
    import torch
    out = {}
    for task, task_batches in batches.items():
        out[task] = []
        for b in task_batches:
            ids = b["input_ids"].masked_fill(b["input_ids"] == eos, eos + 1)
            ids[torch.arange(ids.shape[0]), b["attention_mask"].sum(1) - 1] = eos
            out[task].append({**b, "input_ids": ids})
    return out


def perturbed(model, seed: int, scale: float = 0.1, *, num_labels: int | None = None, encoder_only: bool = False):
    """An 'expert': a copy of `model` with seeded Gaussian noise (× `scale`) on every backbone
    parameter (embeddings and pooler too; only the encoder's with `encoder_only`), optionally a new
    head with `num_labels` classes (BERT)."""
    import torch
    out = copy.deepcopy(model)
    if num_labels is not None:
        out.config.num_labels = num_labels
        out.classifier = torch.nn.Linear(out.config.hidden_size, num_labels)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (out.base_model.encoder if encoder_only else out.base_model).parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out.eval()


def batches_for(tasks, seed: int = 0, n_batches: int = 2, bs: int = 6, length: int = 9, vocab: int = 60):
    """Random token batches per task, two rows of each batch padded."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in tasks:
        out[t] = []
        for _ in range(n_batches):
            mask = torch.ones(bs, length, dtype=torch.long)
            mask[0, 5:] = 0
            mask[2, 3:] = 0
            out[t].append(dict(input_ids=torch.randint(1, vocab, (bs, length), generator=g), attention_mask=mask))
    return out


def save_models(root: Path, models: dict) -> None:
    """Each model saved (`featcal.io.models.save_model`: a causal LM's bare decoder stays one) in `root/<name>`."""
    from featcal.io.models import save_model
    for name, model in models.items():
        save_model(model, root / name)


def assert_same_state(a, b) -> None:
    """Two modules hold the same tensors, bit for bit, under the same names in the same order."""
    import torch
    a, b = a.state_dict(), b.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# --- DVC output ------------------------------------------------------------------------------------------


def stages_run(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def stages_skipped(output: str) -> set[str]:
    return set(re.findall(r"Stage '([^']+)' didn't change, skipping", output))


# --- the tiny project, reproduced once ----------------------------------------------------------------------

# What `dvc repro merge collect-expert-features` runs (what tuning and a team's remote start from),
# and what a later plain `dvc repro` adds (the test-set features and everything scored on them).
UPSTREAM = {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features"}
DOWNSTREAM = {"collect-test-features", "evaluate-merged", "calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}

# FEATCAL_TESTS_SERIAL=1: build the tiny project when the first test needs it, not alongside the
# in-process tests (also the default on a single core).
SERIAL = os.environ.get("FEATCAL_TESTS_SERIAL", "") not in ("", "0") or (os.cpu_count() or 1) < 2
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")   # "gw0", "gw1", ... under pytest-xdist


def copy_project(source: Path, dest: Path) -> Path:
    """A full copy of a project (work tree, .git, .dvc with its cache; times kept): DVC and git see
    the same state as in `source`, and nothing done in `dest` reaches `source`. No hard links: tests
    rewrite files in place."""
    shutil.copytree(source, dest, symlinks=True)
    return dest


class TinyProjectBuild:
    """tests/tiny_project.py's project, reproduced in two steps: `dvc repro merge
    collect-expert-features` (then copied as `upstream`), then `dvc repro` (`full`).

    The base model and task files are written at once (torch's global RNG, before any test runs);
    the git/DVC part runs as subprocesses, from a background thread unless SERIAL: one core runs
    the stages while the in-process tests run on the other. The environment is fixed here, so
    tests that change os.environ meanwhile do not reach the build.
    """

    def __init__(self, root: Path, publish: Path | None = None):
        from tiny_project import copy_pipeline, make_base, make_tasks, project_env, tiny_params
        self.root, self.project, self.publish = root, root / "project", publish
        self.env = project_env()
        copy_pipeline(self.project)
        make_base(root / "base")
        params = tiny_params(root / "base", make_tasks(root / "raw"))
        (self.project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._cancelled = False
        self._result: SimpleNamespace | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._build, name="tiny-project-build", daemon=True)
        self._thread.start()

    def result(self) -> SimpleNamespace:
        if self._thread is None and self._result is None and self._error is None:
            self._build()
        elif self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop a build nobody will use (an interrupted session): kill the running DVC command."""
        self._cancelled = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if self._thread is not None:
            self._thread.join()

    def _dvc(self, *args: str) -> str:
        if self._cancelled:
            raise RuntimeError("tiny project build cancelled")
        self._proc = subprocess.Popen([*DVC, *args], cwd=self.project, env=self.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        output = self._proc.communicate()[0]
        if self._proc.returncode != 0:
            raise AssertionError(f"dvc {' '.join(args)} failed ({self._proc.returncode}):\n{output[-8000:]}")
        return output

    def _build(self) -> None:
        from tiny_project import init_repo
        try:
            init_repo(self.project, env=self.env)
            upstream_output = self._dvc("repro", "merge", "collect-expert-features")
            upstream = copy_project(self.project, self.root / "upstream")
            full_output = self._dvc("repro")
            self._result = SimpleNamespace(root=self.root, upstream=upstream, full=self.project,
                                           upstream_output=upstream_output, full_output=full_output)
            if self.publish is not None:   # for the other xdist workers (SharedBuild)
                done = {k: str(v) for k, v in vars(self._result).items()}
                (self.publish / "result.json.tmp").write_text(json.dumps(done))
                os.replace(self.publish / "result.json.tmp", self.publish / "result.json")
        except BaseException as error:  # handed to the tests that need the project
            self._error = error
            if self.publish is not None:
                (self.publish / "error.txt").write_text(f"{type(error).__name__}: {error}"[-8000:])

    def finish(self) -> None:
        """At the session's end: a build others may be waiting for runs to its end; else it stops."""
        if self.publish is not None and self._thread is not None:
            self._thread.join()
        else:
            self.cancel()


class SharedBuild:
    """Another xdist worker's build of the tiny project: wait for its result, published as files."""

    def __init__(self, publish: Path, timeout_s: float = 900.0):
        self.publish, self.timeout_s = publish, timeout_s

    def result(self) -> SimpleNamespace:
        deadline = time.monotonic() + self.timeout_s
        while not (self.publish / "result.json").exists():
            if (self.publish / "error.txt").exists():
                raise AssertionError("the tiny project's build failed in another worker: "
                                     + (self.publish / "error.txt").read_text())
            if time.monotonic() > deadline:
                raise TimeoutError(f"no tiny project from another worker after {self.timeout_s:.0f} s")
            time.sleep(0.5)
        done = json.loads((self.publish / "result.json").read_text())
        return SimpleNamespace(**{k: Path(v) if k in ("root", "upstream", "full") else v for k, v in done.items()})

    def finish(self) -> None:
        pass


def _uses_tiny_project(item) -> bool:
    return "tiny_project" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first, the longest first (`@pytest.mark.slow(seconds)`, about what one takes
    alone), so that two xdist workers do not end on one long test each: under `--dist worksteal` each
    worker takes half of this list in order, and one that runs out steals from the end of the
    other's. The slow tests on the tiny project come after the other slow ones, so that the project
    builds meanwhile. Otherwise the order stays the files' (a slow test runs before the quick tests
    of its module, which share its module-scoped project; slow tests of equal seconds keep theirs)."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items[:] = sorted(items, key=lambda item: (item.get_closest_marker("slow") is None, _uses_tiny_project(item),
                                               -slow_seconds(item), item.module not in slow_modules))


def slow_seconds(item) -> float:
    """The seconds a `slow` test is marked with (`@pytest.mark.slow(30)`); 5 when unsaid, 0 if not slow."""
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else float(mark.args[0]) if mark.args else 5.0


@pytest.fixture(autouse=True, scope="session")
def _tiny_project_build(request, tmp_path_factory, warm_stage_starts):
    """Starts the tiny project's build as the session starts, when a selected test needs it."""
    if not any(_uses_tiny_project(item) for item in request.session.items):
        yield None
        return
    if XDIST_WORKER:   # one build for all workers: the first to claim the folder builds it
        shared = tmp_path_factory.getbasetemp().parent / "tiny_project_shared"
        try:
            shared.mkdir()
        except FileExistsError:
            build = SharedBuild(shared)
        else:
            (shared / "build").mkdir()
            build = TinyProjectBuild(shared / "build", publish=shared)
            build.start()
    else:
        build = TinyProjectBuild(tmp_path_factory.mktemp("tiny_project"))
        if not SERIAL:
            build.start()
    yield build
    build.finish()


@pytest.fixture(scope="session")
def tiny_project(_tiny_project_build):
    """The reproduced tiny project (see TinyProjectBuild): `upstream` and `full` project folders and
    the two `dvc repro` outputs. Read-only for tests: take a copy (`copy_project`) to change anything."""
    return _tiny_project_build.result()
