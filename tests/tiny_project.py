"""A tiny, fully local copy of the demo pipeline: random 2-layer BERT, two synthetic tasks.

The pieces (base, tasks, params, project) are separate functions taking their sizes as arguments,
so bench/pipeline_lazy.py builds its large synthetic project with the same code the tests use.
"""

from __future__ import annotations

import os
import time
import re
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

import torch
import yaml
from dvc_served import DVC
from transformers import (BertConfig, BertModel, BertTokenizer, CLIPConfig, CLIPModel, CLIPTokenizer,
                          CLIPVisionModelWithProjection, LlamaConfig, LlamaModel, MPNetConfig, MPNetModel, Qwen2Config,
                          Qwen2ForCausalLM, T5Config, T5Model, ViTConfig, ViTImageProcessorPil, ViTModel)

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["good", "bad", "great", "awful", "movie", "film", "sport", "team", "vote", "party", "the", "a", "and", "news"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# task -> (words that mark label 0, words that mark label 1)
RULES = {"sentiment": (["good", "great"], ["bad", "awful"]), "topic": (["sport", "team"], ["vote", "party"])}
FILLER = WORDS[10:]   # the words a sentence is padded with


def make_vocab(words: Sequence[str], size: int | None = None) -> list[str]:
    """Special tokens, then `words`, then `[unusedN]` fillers up to `size` entries (as BERT's vocab
    reserves unused slots): a large vocabulary costs embedding memory like a real model's."""
    vocab = SPECIALS + [w for w in words if w not in SPECIALS]
    if size is not None:
        if size < len(vocab):
            raise ValueError(f"vocabulary of {size} entries cannot hold the {len(vocab)} special tokens and words")
        vocab += [f"[unused{i}]" for i in range(size - len(vocab))]
    return vocab


def make_base(path: Path, layers: int = 2, *, hidden: int = 32, heads: int = 4, intermediate: int = 64,
              vocab: Sequence[str] | None = None, max_positions: int = 64, seed: int = 0) -> None:
    """A randomly initialised (seeded) bare BERT and its word-level tokenizer, saved as an HF folder."""
    vocab = list(vocab) if vocab is not None else make_vocab(WORDS)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, max_position_embeddings=max_positions)
    BertModel(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)


def make_llama_base(path: Path, layers: int = 2, *, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 64, seed: int = 0) -> None:
    """make_base's counterpart for the Llama family: a seeded random bare Llama (grouped-query
    attention, RMSNorm, SwiGLU) with the same word-level tokenizer, its [PAD] as the pad token."""
    vocab = make_vocab(WORDS)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64, pad_token_id=vocab.index("[PAD]"))
    LlamaModel(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)


def make_causal_lm_base(path: Path, layers: int = 2, *, hidden: int = 32, seed: int = 0) -> None:
    """A seeded random tiny Qwen2 causal LM (grouped-query attention, q/k/v biases, tied embeddings)
    with the same word-level tokenizer, its [PAD] as the pad token: a base for language-model tasks."""
    vocab = make_vocab(WORDS)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=vocab.index("[PAD]"), tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)


def make_mpnet_base(path: Path, layers: int = 2, *, hidden: int = 32, heads: int = 4, intermediate: int = 64,
                    seed: int = 0) -> None:
    """make_base's counterpart for MPNet (relative position bias shared by every block), with the
    same word-level tokenizer; its position table has the 32 buckets the encoder always asks for."""
    vocab = make_vocab(WORDS)
    torch.manual_seed(seed)
    config = MPNetConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=intermediate, max_position_embeddings=64, pad_token_id=vocab.index("[PAD]"))
    MPNetModel(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)


def make_t5_base(path: Path, encoder_layers: int = 1, decoder_layers: int = 1, *, d_model: int = 32, heads: int = 4,
                 d_ff: int = 64, seed: int = 0) -> None:
    """make_base's counterpart for T5: a seeded random bare T5 encoder-decoder with the same word-level
    tokenizer; its [SEP] (one per example) is the EOS whose decoder state the classifier reads, [PAD]
    the pad and decoder start token."""
    vocab = make_vocab(WORDS)
    torch.manual_seed(seed)
    pad = vocab.index("[PAD]")
    config = T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_heads=heads,
                      num_layers=encoder_layers, num_decoder_layers=decoder_layers, relative_attention_num_buckets=8,
                      relative_attention_max_distance=16, pad_token_id=pad, decoder_start_token_id=pad,
                      eos_token_id=vocab.index("[SEP]"))
    T5Model(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)


def tiny_clip_tokenizer() -> CLIPTokenizer:
    """Byte-level BPE with no merges: one token per letter (plus an end-of-word form); the special
    tokens come last, so the EOS id is also the largest id (both of CLIP's EOS poolings agree)."""
    chars = list(string.ascii_lowercase) + ["."]
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])


def make_clip_base(path: Path, text_path: Path, layers: int = 2, *, hidden: int = 32, heads: int = 4,
                   intermediate: int = 64, projection: int = 16, image_size: int = 8, patch_size: int = 2,
                   seed: int = 0) -> None:
    """A seeded random tiny CLIP for 8x8 images: the whole model and its tokenizer at `text_path`
    (what zero-shot heads are made from), its vision tower with projection and an image processor
    at `path` (the base), as one takes a CLIP-ViT base from a CLIP checkpoint."""
    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(seed)
    tower = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=heads, projection_dim=projection)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=32, **tower, **special),
                        vision_config=dict(image_size=image_size, patch_size=patch_size, **tower),
                        projection_dim=projection)
    CLIPModel(config).save_pretrained(text_path)
    tokenizer.save_pretrained(text_path)
    CLIPVisionModelWithProjection.from_pretrained(text_path).save_pretrained(path)
    ViTImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                         image_std=[0.5] * 3).save_pretrained(path)


def make_vit_base(path: Path, layers: int = 2, *, hidden: int = 32, heads: int = 4, intermediate: int = 64,
                  image_size: int = 8, patch_size: int = 2, seed: int = 0) -> None:
    """make_base's counterpart for image tasks: a seeded random bare ViT for 8x8 images (the digits'
    size; 16 patches and CLS) and its image processor."""
    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=intermediate, image_size=image_size, patch_size=patch_size)
    ViTModel(config, add_pooling_layer=False).save_pretrained(path)
    ViTImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                         image_std=[0.5] * 3).save_pretrained(path)


def image_tasks(*, max_train: int = 60, n_dev: int = 20, n_test: int = 30) -> dict[str, dict]:
    """Two tasks on the same digit images that conflict: even/odd and low (0-4)/high (5-9)."""
    return {task: {"source": "package:digits", "label_field": task, "max_train": max_train, "n_dev": n_dev,
                   "n_test": n_test} for task in ("parity", "magnitude")}


def make_tasks(path: Path, n: int = 120, *, rules: Mapping[str, tuple[list[str], list[str]]] = RULES,
               filler: Sequence[str] = FILLER, max_train: int = 60, n_dev: int = 20, n_test: int = 30,
               seed: int = 0) -> dict[str, dict]:
    """One two-class CSV per task (a label-0 or label-1 word among filler words); returns the
    params `tasks` entries that read them (`source: file:...`)."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    specs = {}
    for task, (pos, neg) in rules.items():
        rows = []
        for i in range(n):
            label = i % 2
            words = [rng.choice(filler) for _ in range(rng.randint(3, 8))]
            words.insert(rng.randint(0, len(words)), rng.choice(neg if label else pos))
            rows.append((" ".join(words) + f" {i}", label))
        csv = path / f"{task}.csv"
        csv.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
        specs[task] = {"source": f"file:{csv}", "max_train": max_train, "n_dev": n_dev, "n_test": n_test}
    return specs


def tiny_params(base: Path, tasks: dict) -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["base"] = str(base)
    params["tasks"] = tasks
    params["tokens"] = {"max_length": 16, "per_task": {}}
    params["finetune"] = {"learning_rate": 1e-3, "epochs": 2, "batch_size": 16, "overrides": {}}
    params["calibration"] = {"examples_per_task": 24, "batch_size": 8}
    params["evaluate"] = {"drift_examples_per_task": 16}
    # the exact search: the demo's reduced one calibrates its trials on 32 examples a task, more than the
    # tiny sample's 24 (the reduced search's own tests set it)
    params["tune"].update({"trial_examples_per_task": None, "trial_product_dtype": None, "rerank_top_k": 0})
    # the tests' merge stays Task Arithmetic whatever anchor the demo's dev-chosen default is
    params["merge"] = {"method": "task_arithmetic", "options": {"scale": 0.3}}
    # three anchors (of params.yaml's eleven) for the comparison runs: the data-free classics
    params["compare"]["anchors"] = {k: params["compare"]["anchors"][k] for k in ("average", "task_arithmetic", "ties")}
    params["compare"].update({"examples_per_task": 16, "sample_sizes": [4, 16], "surgery": {"iterations": 20},
                              "probsurgery": {"iterations": 20}})
    params["compare"]["sigmerge"].update({"grid": [[0.01, 0.05], [0.05, 0.3]], "shared_examples_per_task": 4})
    return params


def project_env() -> dict[str, str]:
    """The environment a stage gets: offline hub, and this interpreter's folder first on PATH
    (stage commands say `python`)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def run(cmd: list[str], cwd: Path, env: Mapping[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=dict(env) if env is not None else project_env(), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def copy_pipeline(project: Path) -> None:
    """The project's pipeline definition and the code its stages run (no data, no lock files)."""
    project.mkdir()
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, project / name)
    for folder in ("stages", "compare"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__", "dvc.lock"))
    shutil.copytree(ROOT / "featcal", project / "featcal", ignore=shutil.ignore_patterns("__pycache__"))


def init_repo(project: Path, message: str = "tiny project", env: Mapping[str, str] | None = None) -> None:
    """git + DVC repository with the chain generated for the params, everything committed."""
    (project / ".gitignore").write_text("__pycache__/\n")
    run(["git", "init", "-q"], project, env)
    run(["git", "config", "user.email", "test@example.com"], project, env)
    run(["git", "config", "user.name", "test"], project, env)
    run([*DVC, "init", "-q"], project, env)
    run([sys.executable, "stages/gen_chain.py"], project, env)
    run(["git", "add", "-A"], project, env)
    run(["git", "commit", "-qm", message], project, env)


def make_project(root: Path, params: dict | None = None, folder: str | None = None) -> Path:
    """A git repository with the project's pipeline files and `params` (default: the tiny base and
    tasks, built under `root`); returns its path, `root/project`. With `folder`, the same params also
    make a second pipeline in that subfolder (its dvc.yaml generated from the root's, as mpnet/'s
    is); the path returned is then the subfolder's, where DVC runs it."""
    project = root / "project"
    copy_pipeline(project)
    if params is None:
        make_base(root / "base")
        params = tiny_params(root / "base", make_tasks(root / "raw"))
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if folder is not None:
        (project / folder).mkdir()
        (project / folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        run([sys.executable, "stages/gen_pipeline.py", folder], project)
        run([sys.executable, "../stages/gen_chain.py"], project / folder)
    init_repo(project)
    return project if folder is None else project / folder


def run_dvc_logged(args: list[str], log: Path, cwd: Path | None = None, env: dict | None = None,
                   warm: bool = False) -> tuple[list[str], float]:
    """`python -m dvc <args>` with its whole output in `log`; echoes each stage as it starts and
    returns the stages run, in order, and the wall seconds. A failure exits naming the log. `warm`:
    under stages/with_warm_stages.py, as `make repro` and `make exp` run DVC (its start counted)."""
    start = time.perf_counter()
    stages: list[str] = []
    served = [sys.executable, str(ROOT / "stages/with_warm_stages.py")] if warm else []
    with open(log, "w") as out:
        proc = subprocess.Popen([*served, sys.executable, "-m", "dvc", *args], cwd=cwd, env=env or project_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            found = re.search(r"Running stage '([^']+)'", line)
            if found:
                stages.append(found.group(1))
                print(f"  [{time.perf_counter() - start:7.1f} s] {found.group(1)}", flush=True)
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"dvc {' '.join(args)} failed ({code}); full log {log}:\n{log.read_text()[-4000:]}")
    return stages, time.perf_counter() - start
