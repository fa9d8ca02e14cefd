"""A tiny, fully local copy of the demo pipeline: random 2-layer BERT, two synthetic tasks."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import BertConfig, BertModel, BertTokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["good", "bad", "great", "awful", "movie", "film", "sport", "team", "vote", "party", "the", "a", "and", "news"]


def make_base(path: Path, layers: int = 2) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)


def make_tasks(path: Path, n: int = 120) -> dict[str, dict]:
    rng = random.Random(0)
    path.mkdir(parents=True, exist_ok=True)
    rules = {"sentiment": (["good", "great"], ["bad", "awful"]), "topic": (["sport", "team"], ["vote", "party"])}
    specs = {}
    for task, (pos, neg) in rules.items():
        rows = []
        for i in range(n):
            label = i % 2
            words = [rng.choice(WORDS[10:]) for _ in range(rng.randint(3, 8))]
            words.insert(rng.randint(0, len(words)), rng.choice(neg if label else pos))
            rows.append((" ".join(words) + f" {i}", label))
        csv = path / f"{task}.csv"
        csv.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
        specs[task] = {"source": f"file:{csv}", "max_train": 60, "n_dev": 20, "n_test": 30}
    return specs


def tiny_params(base: Path, tasks: dict) -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["base"] = str(base)
    params["tasks"] = tasks
    params["tokens"] = {"max_length": 16, "per_task": {}}
    params["finetune"] = {"learning_rate": 1e-3, "epochs": 2, "batch_size": 16, "overrides": {}}
    params["calibration"] = {"examples_per_task": 24, "batch_size": 8}
    params["evaluate"] = {"drift_examples_per_task": 16}
    params["compare"].update({"examples_per_task": 16, "sample_sizes": [4, 16], "surgery": {"iterations": 20},
                              "probsurgery": {"iterations": 20}})
    params["compare"]["sigmerge"].update({"grid": [[0.01, 0.05], [0.05, 0.3]], "shared_examples_per_task": 4})
    return params


def run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def make_project(root: Path) -> Path:
    """A git repository with the project's pipeline files and tiny params; returns its path."""
    project = root / "project"
    project.mkdir()
    for name in ("dvc.yaml",):
        shutil.copy(ROOT / name, project / name)
    for folder in ("stages", "compare"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__", "dvc.lock"))
    shutil.copytree(ROOT / "featcal", project / "featcal", ignore=shutil.ignore_patterns("__pycache__"))
    make_base(root / "base")
    params = tiny_params(root / "base", make_tasks(root / "raw"))
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / ".gitignore").write_text("__pycache__/\n")
    run(["git", "init", "-q"], project)
    run(["git", "config", "user.email", "test@example.com"], project)
    run(["git", "config", "user.name", "test"], project)
    run([sys.executable, "-m", "dvc", "init", "-q"], project)
    run([sys.executable, "stages/gen_chain.py"], project)
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "tiny project"], project)
    return project
