"""Peak memory and wall time of FeatCal with lazy per-layer loading vs every expert loaded whole.

A synthetic BERT (default: 24 layers, hidden 768, intermediate 3072, BERT-base vocabulary) is
saved as a base and N experts (the base plus small seeded perturbations of every backbone
parameter, each with its own classification head); the merged model is written by `lazy_merge`
(task arithmetic). Then each mode runs in its own fresh subprocess, one after the other:

- whole: `AutoModel.from_pretrained` of the base and every expert, then `featcal.calibration.calibrate`;
- lazy:  `featcal.calibration.lazy.calibrate_lazy`, reading one block of the base and of every expert at a time.

Both calibrate the merged model in place on the same tiny calibration set (default 8 examples ×
16 tokens per task: the comparison is about model memory, not activations). Each child reports
its peak resident set size (getrusage ru_maxrss) and its load / calibration times, and a sha256 of
the calibrated weights, so the two modes are also checked to agree exactly.

    .venv/bin/python bench/lazy_vs_whole.py                 # the full size (~7.8 GB of disk, ~10 GB RAM)
    .venv/bin/python bench/lazy_vs_whole.py --layers 4 --hidden 256 --intermediate 1024 --experts 3   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gib(kib: float) -> str:
    return f"{kib / 2**20:.2f} GiB"


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --- setup (parent) -------------------------------------------------------------------------------------


def build(args, work: Path) -> dict:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(args.seed)
    cfg = BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64 or 1, intermediate_size=args.intermediate, num_labels=2,
    )
    t0 = time.perf_counter()
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(work / "base")
    base_state = {k: v.clone() for k, v in model.bert.state_dict().items()}
    experts = {}
    for i in range(args.experts):
        g = torch.Generator().manual_seed(args.seed + 1 + i)
        with torch.no_grad():
            for name, p in model.bert.named_parameters():
                p.copy_(base_state[name] + 0.02 * torch.randn(p.shape, generator=g))
            model.classifier.weight.normal_(0, 0.02, generator=g)
        experts[f"task{i}"] = work / f"task{i}"
        model.save_pretrained(experts[f"task{i}"])
        print(f"  saved expert {i + 1}/{args.experts}", flush=True)
    del model, base_state
    t_merge = time.perf_counter()
    # the merge itself runs in a child too, so its peak memory is measured alone
    merge = run_child(args, work, "merge")
    print(f"  built in {t_merge - t0:.0f} s; lazy_merge: peak RSS {gib(merge['peak_rss_kib'])}, "
          f"{merge['seconds']:.1f} s", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    batches = {
        t: [dict(input_ids=torch.randint(1, args.vocab, (args.examples, args.tokens), generator=g),
                 attention_mask=torch.ones(args.examples, args.tokens, dtype=torch.long))]
        for t in experts
    }
    torch.save(batches, work / "batches.pt")
    (work / "experts.json").write_text(json.dumps({t: str(p) for t, p in experts.items()}))
    return merge


# --- the measured runs (children) ---------------------------------------------------------------------------


def child(mode: str, work: Path, threads: int) -> None:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModel

    from featcal.calibration.walk import calibrate
    from featcal.calibration.distributed import state_digest
    from featcal.calibration.lazy import calibrate_lazy
    from featcal.merging.lazy import lazy_merge

    experts = {t: Path(p) for t, p in json.loads((work / "experts.json").read_text()).items()} \
        if (work / "experts.json").exists() else None
    out: dict = {"mode": mode}
    if mode == "merge":
        dirs = sorted((p for p in work.iterdir() if p.name.startswith("task")), key=lambda p: int(p.name[4:]))
        t0 = time.perf_counter()
        lazy_merge(work / "base", dirs, "task_arithmetic", {"scale": 0.3}, work / "merged", progress=False)
        out["seconds"] = time.perf_counter() - t0
    else:
        batches = torch.load(work / "batches.pt", weights_only=True)
        t0 = time.perf_counter()
        merged = AutoModel.from_pretrained(work / "merged").eval()
        if mode == "whole":
            base = AutoModel.from_pretrained(work / "base").eval()
            loaded = {t: AutoModel.from_pretrained(p).eval() for t, p in experts.items()}
            t1 = time.perf_counter()
            result = calibrate(merged, base, loaded, batches, inplace=True, progress=False)
        else:
            t1 = time.perf_counter()
            result = calibrate_lazy(merged, work / "base", experts, batches, inplace=True, progress=False)
        t2 = time.perf_counter()
        out.update(load_s=t1 - t0, calibrate_s=t2 - t1, digest=state_digest(result.backbone),
                   last_drift_l2=result.drift[-1].l2)
    out["startup_s"] = t0 - t_start
    out["peak_rss_kib"] = peak_rss_kib()
    print("RESULT " + json.dumps(out), flush=True)


def run_child(args, work: Path, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--workdir", str(work), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    result["wall_s"] = wall
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--examples", type=int, default=8, help="calibration examples per task")
    p.add_argument("--tokens", type=int, default=16, help="tokens per example")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (same for both modes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--reuse", action="store_true", help="reuse the checkpoints already in --workdir")
    p.add_argument("--child", choices=["merge", "whole", "lazy"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, Path(args.workdir), args.threads)
        return

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="featcal-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.reuse and (work / "experts.json").exists() and (work / "merged").exists():
            print(f"reusing the checkpoints in {work}", flush=True)
            merge = run_child(args, work, "merge")
        else:
            print(f"setting up in {work}", flush=True)
            merge = build(args, work)
        runs = {}
        for mode in ("whole", "lazy"):
            print(f"  running {mode} …", flush=True)
            runs[mode] = run_child(args, work, mode)
        per_model = folder_bytes(work / "base")
        on_disk = sum(folder_bytes(work / n) for n in ["base", "merged", *json.loads((work / "experts.json").read_text())])
        whole, lz = runs["whole"], runs["lazy"]
        print()
        print(f"featcal lazy vs whole: BERT {args.layers} layers, hidden {args.hidden}, intermediate "
              f"{args.intermediate}, vocab {args.vocab}; {args.experts} experts; {args.examples} examples × "
              f"{args.tokens} tokens per task; {args.threads} torch thread(s)")
        print(f"checkpoint: {per_model / 1e6:.0f} MB per model; base + {args.experts} experts + merged on disk: "
              f"{on_disk / 1e9:.1f} GB")
        print(f"lazy_merge (task_arithmetic, writes the merged model): peak RSS {gib(merge['peak_rss_kib'])}, "
              f"{merge['seconds']:.1f} s")
        print(f"{'mode':<6} {'peak RSS':>10} {'load':>8} {'calibrate':>10} {'wall':>8}")
        for mode, r in runs.items():
            print(f"{mode:<6} {gib(r['peak_rss_kib']):>10} {r['load_s']:>7.1f}s {r['calibrate_s']:>9.1f}s "
                  f"{r['wall_s']:>7.1f}s")
        print(f"whole / lazy: peak RSS {whole['peak_rss_kib'] / lz['peak_rss_kib']:.2f}×, "
              f"wall time {whole['wall_s'] / lz['wall_s']:.2f}×")
        same = whole["digest"] == lz["digest"]
        print(f"identical calibrated weights (sha256 of the state dict): {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(1)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
