"""One anchor through the tuning protocol: its merge, then a dev study per post-merge method (not a stage).

    python stages/tune_anchor.py wudi                          # FeatCal, Surgery, ProbSurgery on WUDI
    python stages/tune_anchor.py task_arithmetic --anchor-search scale=0.1:1.0 --n-trials 48
    python stages/tune_anchor.py ties --sigmerge                # SigMerge(TIES) + FeatCal, (c_min, c_max) searched
    python stages/tune_anchor.py ties --methods featcal --variant per_layer --search alpha=0:1 rho=0.5:3 \
        ridge=1e-5:1:log alpha@0=0:1 alpha@1=0:1 alpha@2=0:1 alpha@3=0:1 alpha@4=0:1 alpha@5=0:1

The anchor is merged once with `compare.anchors.<anchor>`'s options (`stages/merge.py` on a params
file naming it, kept under --work and reused while those options and the experts' files stay the
same); then, for each method, `stages/tune.py --method <m> --score-test` runs a seeded, resumable
study of --n-trials (default `tune.n_trials`) scored on dev, reads test once for the dev-best configuration and writes
`<out>/<anchor>_<method>.json` (what `stages/compare_tuned.py` tabulates). Every study of the
comparison starts from the same place: FeatCal's first trial is the spec's defaults (α 0.25, ρ 2.2,
λ 0.05) with the pooler calibrated, Surgery's and ProbSurgery's their papers' defaults; the ranges
are `tune.search`'s and the baselines' own. `--anchor-search` also searches the anchor's options
(`tune.anchor_search`). `--sigmerge` studies SigMerge(anchor) + FeatCal instead: SigMerge repairs
the anchor (at its compare.anchors options; a data anchor's data options become SigMerge's) and each trial searches its (c_min,
c_max) (default: over compare.sigmerge.grid's span) next to FeatCal's values; the summary is
`<anchor>_sigmerge_featcal.json`. `--search KEY=LOW:HIGH[:log] ... --variant NAME` runs a study beside
the protocol's with another FeatCal search (per-layer α: alpha@0=0:1 ... alpha@5=0:1 next to
alpha, rho, ridge), named and summarised with the suffix NAME. The experts' cached features come
from the pipeline (`make repro` first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from common import get, load_params, positive_int

from featcal.calibration.config import FeatCalConfig
from featcal.io.models import write_json
from featcal.io.split_packages import sha256_of
from featcal.merging import split_options
from featcal.tuning.comparison import METHODS

STAGES = Path(__file__).resolve().parent


def anchor_params(params: dict, anchor: str, searched: dict[str, list[float]], pooler: bool,
                  sigmerge: bool = False) -> dict:
    """The project's params with the anchor as the merge (with `sigmerge`, SigMerge repairing it at
    SigMerge's defaults), FeatCal at the spec's defaults (the first trial) and the searched options,
    paths made absolute for a run from another folder."""
    anchors = get(params, "compare.anchors")
    if anchor not in anchors:
        raise SystemExit(f"tune_anchor: {anchor!r} is not in compare.anchors ({', '.join(anchors)})")
    spec = FeatCalConfig()
    out = json.loads(json.dumps(params))   # a deep copy
    out["merge"] = {"method": anchor, "options": dict(anchors[anchor] or {})}
    if sigmerge:   # a data anchor's data options (RegMean's examples_per_task) are SigMerge's own
        options, data = split_options(anchor, anchors[anchor] or {})
        out["merge"] = {"method": "sigmerge", "options": {
            "anchor": anchor, "anchor_options": options, **data,
            "shared_examples_per_task": int(get(params, "compare.sigmerge.shared_examples_per_task"))}}
    out["featcal"].update(alpha=spec.alpha, rho=spec.rho, ridge=spec.ridge, calibrate_pooler=pooler, use_tuned=False)
    out["tune"]["anchor_search"] = searched
    out["tasks_dir"] = str(Path(get(params, "tasks_dir")).resolve())
    return out


def parse_search(items: list[str], flag: str = "--anchor-search") -> dict:
    """KEY=LOW:HIGH[:log] items as tune.search / tune.anchor_search ranges."""
    out = {}
    for item in items:
        key, _, span = item.partition("=")
        low, _, rest = span.partition(":")
        high, _, scale = rest.partition(":")
        try:
            if scale not in ("", "log"):
                raise ValueError(scale)
            out[key] = {"low": float(low), "high": float(high), "log": True} if scale else [float(low), float(high)]
        except ValueError:
            raise SystemExit(f"tune_anchor: {flag} {item!r}: expected KEY=LOW:HIGH or KEY=LOW:HIGH:log, "
                             "e.g. scale=0.1:1.0") from None
    return out


def examples_or_all(text: str) -> int | str:
    """--trial-examples-per-task: a positive count, or `all`."""
    if text == "all":
        return text
    return positive_int(text)


def sigmerge_search(params: dict) -> dict[str, list[float]]:
    """SigMerge's (c_min, c_max) searched over the span of `compare.sigmerge.grid`."""
    grid = get(params, "compare.sigmerge.grid")
    return {"c_min": [min(c for c, _ in grid), max(c for c, _ in grid)],
            "c_max": [min(c for _, c in grid), max(c for _, c in grid)]}


def run(cmd: list[str], cwd: Path, log: Path) -> None:
    """Run a stage script in `cwd`, its output in `log`; a failure exits with the log's tail."""
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"tune_anchor: {' '.join(cmd[1:3])} failed ({code}); log {log}:\n{log.read_text()[-3000:]}")


def experts_identity(experts: Path) -> str:
    """Every file under the experts' folder by name and content (SHA-256): new experts (another
    fine-tuning, another machine's) name another merge, where the options alone would reuse a stale one,
    while the same experts written again (`make repro` on a fresh checkout: same bytes, new times) keep
    theirs."""
    files = sorted(p for p in experts.rglob("*") if p.is_file())
    return json.dumps([[str(p.relative_to(experts)), sha256_of(p)] for p in files])


def merged_anchor(local: dict, name: str, experts: Path, identity: str, work: str) -> Path:
    """The folder of the anchor's merge under `work` (one per merge options and experts: `identity` is
    `experts_identity(experts)`, hashed once a run), merged once by `stages/merge.py` from the folder's
    params.yaml (the merge stage writes whole or not at all)."""
    options = json.dumps(local["merge"], sort_keys=True) + identity
    folder = (Path(work) / f"{name}-{hashlib.sha1(options.encode()).hexdigest()[:8]}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    merged = folder / "merged"
    if not merged.exists():
        print(f"{name}: merging with {local['merge']['options']} -> {merged}", flush=True)
        (folder / "params.yaml").write_text(yaml.safe_dump(local, sort_keys=False))
        run([sys.executable, str(STAGES / "merge.py"), "--experts", str(experts), "--out", str(merged),
             "--record", str(folder / "record")], folder, folder / "merge.log")
    return folder


def tune_command(args: argparse.Namespace, params_file: Path, folder: Path, storage: str, study: str, method: str,
                 summary_file: Path, extra: list[str]) -> list[str]:
    """`stages/tune.py` on the anchor's merge in `folder`: `method`'s study, its summary, test read once."""
    experts, features = (str(Path(p).resolve()) for p in (args.experts, args.features))
    return [sys.executable, str(STAGES / "tune.py"), "--params", str(params_file), "--merged", str(folder / "merged"),
            "--experts", experts, "--features", features, "--storage", storage, "--study-name", study,
            "--method", method, "--summary", str(summary_file), "--score-test", *extra]


def searched_in_study(storage: str, study_name: str) -> dict:
    """The anchor options a finished study searched, with its ranges, from its best trial's
    distributions (what `--anchor-search` or `--sigmerge` gave when it ran)."""
    import optuna

    from featcal.tuning.objective import AnchorSearch

    trial = optuna.load_study(study_name=study_name, storage=storage).best_trial
    out = {}
    for key, dist in trial.distributions.items():
        if key.startswith(AnchorSearch.PREFIX):
            out[key[len(AnchorSearch.PREFIX):]] = ({"low": dist.low, "high": dist.high, "log": True} if dist.log
                                                   else [dist.low, dist.high])
    return out


def absolute_storage(url: str | None) -> str | None:
    """A sqlite URL with a relative file made absolute: the studies run from the anchor's folder, where
    the same relative path would name another file (other backends as they are)."""
    from featcal.tuning.study import sqlite_path

    path = None if url is None else sqlite_path(url)
    return url if path is None or path.is_absolute() else f"sqlite:///{path.resolve()}"


def rescore(args: argparse.Namespace, params: dict) -> None:
    """Each finished study of the anchor again, no trial run: its dev-best model's dev and test
    predictions to --predictions, and whether the scores reproduce the summary's, in
    <predictions>/rescored.json. The committed study file is read from a copy, never written."""
    methods = args.methods or (["featcal"] if args.sigmerge else list(METHODS[1:]))
    out, predictions = Path(args.out).resolve(), Path(args.predictions).resolve()
    name = f"{args.anchor}-sigmerge" if args.sigmerge else args.anchor
    record_file = predictions / "rescored.json"
    failed: list[str] = []
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    storage = args.storage
    if storage is None:   # a copy: opening a study may write to its file
        shutil.copyfile(out / "study.db", work / "rescore-study.db")
        storage = f"sqlite:///{work / 'rescore-study.db'}"
    experts = Path(args.experts).resolve()
    identity = experts_identity(experts)   # one read of the experts for every method's folder
    for method in methods:
        key = f"sigmerge_{method}" if args.sigmerge else method
        summary_file = out / f"{args.anchor}_{key}.json"
        if not summary_file.exists():
            print(f"{name}: no {summary_file.name}: {method} not rescored", flush=True)
            continue
        summary = json.loads(summary_file.read_text())
        local = anchor_params(params, args.anchor, searched_in_study(storage, summary["study"]),
                              pooler=not args.no_pooler, sigmerge=args.sigmerge)
        # the study's search mode: its calibration examples (a summary without them: every example) and,
        # where the summary says, its products' dtype
        local["tune"]["trial_examples_per_task"] = summary.get("trial_examples_per_task")
        if "trial_product_dtype" in summary:
            local["tune"]["trial_product_dtype"] = summary["trial_product_dtype"]
        # a reranked study's choice is rebuilt (its exact scores are in the study: nothing is reranked again)
        local["tune"]["rerank_top_k"] = summary.get("rerank", {}).get("top_k", 0)
        folder = merged_anchor(local, name, experts, identity, args.work)
        params_file = folder / f"params-rescore-{method}.yaml"
        params_file.write_text(yaml.safe_dump(local, sort_keys=False))
        rescored_file = folder / f"rescored-{key}.json"
        print(f"{name}: rescoring {method} study {summary['study']}", flush=True)
        try:
            run(tune_command(args, params_file, folder, storage, summary["study"], method, rescored_file,
                             ["--rescore", "--predictions", str(predictions)]), folder, folder / f"rescore-{method}.log")
        except SystemExit as err:   # the anchor's other studies are rescored all the same
            print(f"  {method}: FAILED: {str(err)[-600:]}", flush=True)
            failed.append(method)
            continue
        again = json.loads(rescored_file.read_text())
        # kept: where the rebuilt model does not reproduce the study (code changed since it ran), the
        # comparison reports the rebuilt model's scores, whose predictions these are
        (predictions / "rescored").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(rescored_file, predictions / "rescored" / f"{args.anchor}_{key}.json")
        check = {"study": summary["study"], "trial": again["best"]["trial"],
                 "fingerprint_matched": again.get("fingerprint_matched", True),
                 "same_trial": again["best"]["trial"] == summary["best"]["trial"],
                 "dev_matches": again["rescored_dev"]["matches_trial"],
                 "test_matches": again["test"] == summary["test"],
                 "test_avg": again["test"]["avg"], "summary_test_avg": summary["test"]["avg"]}
        records = json.loads(record_file.read_text()) if record_file.exists() else {}
        records[f"{args.anchor}/{key}"] = check
        write_json(record_file, dict(sorted(records.items())))
        print(f"  trial {check['trial']}: dev {'reproduced' if check['dev_matches'] else 'DIFFERS'}, test "
              f"{check['test_avg']:.4f} ({'reproduced' if check['test_matches'] else 'summary: %.4f' % check['summary_test_avg']})",
              flush=True)
    if failed:
        raise SystemExit(f"tune_anchor: --rescore: {', '.join(failed)} failed (logs in {args.work})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("anchor", help="a registry name of compare.anchors (its options are the merge's)")
    parser.add_argument("--methods", nargs="+", choices=METHODS[1:], help="default: all (with --sigmerge: featcal)")
    parser.add_argument("--n-trials", type=positive_int,
                        help="trials per study, at least 1 (default tune.n_trials); raising it resumes")
    parser.add_argument("--anchor-search", nargs="*", default=[], metavar="KEY=LOW:HIGH",
                        help="also search these options of the anchor (tune.anchor_search)")
    parser.add_argument("--no-pooler", action="store_true", help="FeatCal leaves the pooler as merged")
    parser.add_argument("--sigmerge", action="store_true",
                        help="SigMerge(anchor) + FeatCal: SigMerge repairs the anchor, its (c_min, c_max) searched "
                             "(default: over compare.sigmerge.grid's span) next to FeatCal's values")
    parser.add_argument("--search", nargs="+", default=[], metavar="KEY=LOW:HIGH[:log]",
                        help="FeatCal's search instead of tune.search, e.g. per-layer α: alpha@0=0:1 ... "
                             "(needs --variant)")
    parser.add_argument("--variant", help="a study beside the protocol's: its name, summary "
                                          "(<anchor>_<method>_<variant>.json) and params file carry this suffix")
    parser.add_argument("--trial-examples-per-task", type=examples_or_all, metavar="N|all",
                        help="tune.trial_examples_per_task for these studies: each trial calibrates on each task's "
                             "first N calibration examples (all: every example); default: params.yaml's")
    parser.add_argument("--trial-product-dtype", choices=["float32", "float64"],
                        help="tune.trial_product_dtype for these studies: the trials' moment products (the best is "
                             "calibrated again with featcal.product_dtype); default: params.yaml's")
    parser.add_argument("--rerank-top-k", type=int, metavar="K",
                        help="tune.rerank_top_k for these studies: a reduced search's K best trials calibrated (or "
                             "trained) again on every example, the best on dev chosen; default: params.yaml's")
    parser.add_argument("--experts", default="experts", help="folder of the experts")
    parser.add_argument("--features", default="features/experts", help="the experts' cached calibration features")
    parser.add_argument("--out", default="results/dev_tuning", help="where <anchor>_<method>.json are written")
    parser.add_argument("--storage", help="Optuna storage (default: sqlite at <out>/study.db)")
    parser.add_argument("--work", default="work/anchors", help="where each anchor's params and merge are kept")
    parser.add_argument("--rescore", action="store_true",
                        help="run no trial: rebuild each finished study's dev-best model (its searched ranges read "
                             "from the study), score it on dev and test again, write its per-example predictions "
                             "to --predictions and check the scores against the study's summary (kept as it is)")
    parser.add_argument("--predictions", default="results/predictions",
                        help="with --rescore: where the predictions (<study>.parquet, Parquet) are written")
    args = parser.parse_args()
    args.storage = absolute_storage(args.storage)
    params = load_params()
    if args.rescore:
        return rescore(args, params)
    searched = parse_search(args.anchor_search) or (sigmerge_search(params) if args.sigmerge else {})
    methods = args.methods or (["featcal"] if args.sigmerge else list(METHODS[1:]))
    if args.sigmerge and methods != ["featcal"]:
        raise SystemExit("tune_anchor: --sigmerge studies SigMerge(anchor) + FeatCal only (--methods featcal)")
    if args.search and not args.variant:
        raise SystemExit("tune_anchor: --search changes the protocol's FeatCal search: name the study with --variant")
    if args.variant and not args.variant.replace("_", "").isalnum():
        raise SystemExit(f"tune_anchor: --variant {args.variant!r}: letters, digits and _ only")
    local = anchor_params(params, args.anchor, searched, pooler=not args.no_pooler, sigmerge=args.sigmerge)
    if args.search:
        local["tune"]["search"] = parse_search(args.search, "--search")
    if args.trial_examples_per_task is not None:
        local["tune"]["trial_examples_per_task"] = None if args.trial_examples_per_task == "all" \
            else args.trial_examples_per_task
    if args.trial_product_dtype is not None:
        local["tune"]["trial_product_dtype"] = args.trial_product_dtype
    if args.rerank_top_k is not None:
        local["tune"]["rerank_top_k"] = args.rerank_top_k
    name = f"{args.anchor}-sigmerge" if args.sigmerge else args.anchor
    experts = Path(args.experts).resolve()
    folder = merged_anchor(local, name, experts, experts_identity(experts), args.work)
    params_file = folder / (f"params-{args.variant}.yaml" if args.variant else "params.yaml")
    params_file.write_text(yaml.safe_dump(local, sort_keys=False))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{out / 'study.db'}"
    tag = "-anchor" if searched and not args.sigmerge else ""
    suffix = f"-{args.variant}" if args.variant else ""
    for method in methods:
        study = f"{name}{tag}-{method}{suffix}"
        key = f"sigmerge_{method}" if args.sigmerge else method   # the comparison's method name
        summary_file = out / (f"{args.anchor}_{key}_{args.variant}.json" if args.variant else f"{args.anchor}_{key}.json")
        print(f"{name}: {method} study {study}", flush=True)
        run(tune_command(args, params_file, folder, storage, study, method, summary_file,
                         ["--n-trials", str(args.n_trials)] if args.n_trials else []),
            folder, folder / f"{method}{suffix}.log")
        summary = json.loads(summary_file.read_text())
        print(f"  dev-best {summary['best']['dev_avg']:.4f} {summary['best']['params']}; test {summary['test']['avg']:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
