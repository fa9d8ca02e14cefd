"""What the tests share: the offline environment, one torch thread, the tiny BERT factories, and
one tiny DVC project reproduced once per session.

Helpers are plain functions (`from conftest import tiny_bert, perturbed, ...`); the tiny project is
the session fixture `tiny_project`, which tests never modify: `project_copy` gives each test
module its own copy (work tree, git history and DVC cache) to change.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads and, on a shared machine, threads spin against each
# other: one thread here and in every subprocess (DVC stages, torchrun workers, tune workers).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

torch.set_num_threads(1)

DVC = [sys.executable, "-m", "dvc"]


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The pin above, kept for the whole session (a test that changes it gets it back)."""
    torch.set_num_threads(1)
    yield


# --- tiny models ----------------------------------------------------------------------------------------


def tiny_bert(seed: int = 0, layers: int = 2, *, vocab: int = 60, hidden: int = 24, intermediate: int = 48,
              positions: int = 32, num_labels: int = 2, dtype: torch.dtype | None = None,
              **config) -> BertForSequenceClassification:
    """A seeded random BERT sequence classifier (4 heads), in eval mode; `config`: more BertConfig keys."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=intermediate, num_labels=num_labels, max_position_embeddings=positions, **config)
    model = BertForSequenceClassification(cfg).eval()
    return model if dtype is None else model.to(dtype)


def perturbed(model, seed: int, scale: float = 0.1, *, num_labels: int | None = None, encoder_only: bool = False):
    """An 'expert': a copy of `model` with seeded Gaussian noise (× `scale`) on every backbone
    parameter (embeddings and pooler too; only the encoder's with `encoder_only`), optionally a new
    head with `num_labels` classes."""
    out = copy.deepcopy(model)
    if num_labels is not None:
        out.config.num_labels = num_labels
        out.classifier = torch.nn.Linear(out.config.hidden_size, num_labels)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (out.bert.encoder if encoder_only else out.bert).parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out.eval()


def batches_for(tasks, seed: int = 0, n_batches: int = 2, bs: int = 6, length: int = 9, vocab: int = 60):
    """Random token batches per task, two rows of each batch padded."""
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


def assert_same_state(a, b) -> None:
    """Two modules hold the same tensors, bit for bit, under the same names in the same order."""
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


def copy_project(source: Path, dest: Path) -> Path:
    """A full copy of a project (work tree, .git, .dvc with its cache; times kept): DVC and git see
    the same state as in `source`, and nothing done in `dest` reaches `source`. No hard links: tests
    rewrite files in place."""
    shutil.copytree(source, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory):
    """tests/tiny_project.py's project, reproduced once for the session in two steps:
    `dvc repro merge collect-expert-features` (snapshot `upstream`), then `dvc repro` (`full`).
    Read-only for tests: take a copy (`copy_project`) to change anything."""
    root = tmp_path_factory.mktemp("tiny_project")
    from tiny_project import make_project, run

    project = make_project(root)
    upstream_output = run([*DVC, "repro", "merge", "collect-expert-features"], project)
    upstream = copy_project(project, root / "upstream")
    full_output = run([*DVC, "repro"], project)
    return SimpleNamespace(root=root, upstream=upstream, full=project,
                           upstream_output=upstream_output, full_output=full_output)
