"""Benchmark (not a test): one calibrate-layer step on a decoder block of Qwen2.5-1.5B's widths, its
peak RSS and phase seconds, for this tree's code and for a baseline commit's, side by side in one run.

The block is what `make bench-llm`'s calibrate-layer stages walk (hidden 1536, MLP 8960, 12 heads,
2 key/value heads, q/k/v biases), with random seeded weights instead of the real checkpoint's:
the cost of a step depends on the shapes and the number of rows, not on the values. Three experts
(the base plus seeded noise), their Task Arithmetic merge (s 0.3), 16 texts a task of 128 tokens in
batches of 4 (llm/params.yaml's sizes), the spec's α, ρ, λ, float64 products, moments not kept.

Each code version runs `featcal.calibration.layerwise.calibrate_cached_layer` on block 0 in its own
subprocess (PYTHONPATH: this tree, or a `git worktree` of --baseline), so each peak RSS is that
process's own; both read the same checkpoints and states. The calibrated weights of the two are
compared (max relative difference), since a cheaper step must compute the same block.

    .venv/bin/python bench/wide_block.py --baseline 982a4e0        # ~3 min; ~3 GB of disk in --work
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
TASKS = ("news", "reviews", "code")


def build(work: Path, seed: int, vocab: int) -> None:
    """The base, three experts and their merge as safetensors folders, the calibration batches and
    the experts' states entering block 0 and 1 (`collect_expert_layers`), once per --work folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from featcal.calibration.layerwise import collect_expert_layers

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=2,
                               max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0)
    base = AutoModelForCausalLM.from_config(cfg).eval()
    base.save_pretrained(work / "base")
    deltas = {}
    for i, task in enumerate(TASKS):
        expert = AutoModelForCausalLM.from_config(cfg).eval()
        expert.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(seed + 1 + i)
        with torch.no_grad():
            for name, p in expert.named_parameters():
                if ".layers." in name:
                    noise = torch.randn(p.shape, generator=g) * 0.02 * float(p.std() if p.numel() > 1 else 1.0)
                    p.add_(noise)
                    deltas[name] = deltas.get(name, 0) + noise
        expert.save_pretrained(work / "experts" / task)
        del expert
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name in deltas:
                p.add_(0.3 * deltas[name])
    base.save_pretrained(work / "merged")
    g = torch.Generator().manual_seed(seed)
    batches = {t: [{"input_ids": torch.randint(1, vocab, (4, 128), generator=g),
                    "attention_mask": torch.ones(4, 128, dtype=torch.long)} for _ in range(4)] for t in TASKS}
    torch.save(batches, work / "batches.pt")
    experts = {t: work / "experts" / t for t in TASKS}
    for layer, states in zip(range(2), collect_expert_layers(experts, batches)):
        torch.save(states, work / f"states_{layer}.pt")
    (work / "built").write_text("ok")


def run_step(work: Path, out: Path) -> None:
    """One calibrate-layer step on block 0 (this process's code), its figures to `out` (JSON) and its
    parameters beside it."""
    import torch
    from safetensors.torch import save_file
    from featcal.calibration.config import FeatCalConfig
    from featcal.calibration.layerwise import calibrate_cached_layer
    from featcal.profiling import phase_times

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    batches = torch.load(work / "batches.pt")
    states = {k: torch.load(work / f"states_{k}.pt") for k in range(2)}
    config = FeatCalConfig.from_mapping({"alpha": 0.25, "rho": 2.2, "ridge": 0.05, "calibrate_pooler": False,
                                         "product_dtype": "float64", "device": "cpu"})
    start = time.perf_counter()
    with phase_times() as phases:
        layer = calibrate_cached_layer(0, work / "merged", work / "base", {t: work / "experts" / t for t in TASKS},
                                       batches, None, states.__getitem__, config, keep_moments=False)
    wall = time.perf_counter() - start
    save_file({k: v.contiguous() for k, v in layer.parameters.items()}, str(out.with_suffix(".safetensors")))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    import featcal
    out.write_text(json.dumps({"code": str(Path(featcal.__file__).parents[1]), "wall_s": round(wall, 2),
                               "peak_rss_mib": round(peak, 1),
                               "phases_s": {k: round(v, 2) for k, v in phases.items()}}))


def baseline_tree(commit: str, work: Path) -> Path:
    tree = work / f"tree-{commit}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
    return tree


def in_subprocess(code: Path, work: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    subprocess.run([sys.executable, __file__, "--step", str(out), "--work", str(work)], check=True, env=env, cwd=code)
    return json.loads(out.read_text())


def max_rel_diff(a: Path, b: Path) -> float:
    """`calibration_cost.max_relative_difference` of two steps' saved parameters (b the reference)."""
    from safetensors.torch import load_file
    from calibration_cost import max_relative_difference
    return max_relative_difference(load_file(str(a)), load_file(str(b)))[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, help="commit whose code runs beside this tree's")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "featcal-wide-block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="runs of each version, alternating")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the figures")
    p.add_argument("--step", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step is not None:
        run_step(args.work, args.step)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.work / "built").exists():
        build(args.work, args.seed, args.vocab)
    versions = {"this tree": ROOT}
    if args.baseline:
        versions = {f"baseline {args.baseline}": baseline_tree(args.baseline, args.work), **versions}
    runs: dict[str, list[dict]] = {name: [] for name in versions}
    for r in range(args.repeats):
        for name, code in versions.items():
            out = args.work / f"{name.split()[-1]}-{r}.json"
            runs[name].append(in_subprocess(code, args.work, out))
            print(f"{name} run {r}: {json.dumps(runs[name][-1])}", flush=True)
    record = {"block": "qwen2 1536/8960, 12 heads, 2 kv heads; 3 tasks x 16 texts x 128 tokens", "runs": runs}
    if args.baseline:
        names = list(versions)
        old, new = (min(runs[n], key=lambda x: x["wall_s"]) for n in names)
        record["peak_rss_ratio"] = round(new["peak_rss_mib"] / old["peak_rss_mib"], 3)
        record["wall_ratio"] = round(new["wall_s"] / old["wall_s"], 3)
        record["max_rel_diff"] = max_rel_diff(args.work / f"{names[1].split()[-1]}-0.safetensors",
                                              args.work / f"{names[0].split()[-1]}-0.safetensors")
        print(f"peak RSS {new['peak_rss_mib']:.0f} / {old['peak_rss_mib']:.0f} MiB = {record['peak_rss_ratio']}; "
              f"wall {new['wall_s']:.1f} / {old['wall_s']:.1f} s = {record['wall_ratio']}; "
              f"max rel diff of the weights {record['max_rel_diff']:.2e}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
