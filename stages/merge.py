"""DVC stage `merge`: base + experts -> merged backbone (method and options from params.yaml).

`merge.method: sigmerge` repairs an anchor merge with data (dev scores, shared train examples);
its record (signals, capacities, deficits, admitted counts) goes to results/merge/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common import enabled_tasks, get, load_params, max_length, setup_logging, timed

from featcal import merge_models
from featcal.compare import load_workbench
from featcal.merging.sigmerge import plot_admitted
from featcal.lazy import lazy_merge, load_head, streams
from featcal.modeling import (atomic_dir, check_experts_fit_base, check_model_types, load_backbone, load_classifier,
                              load_tokenizer, save_heads, save_multitask, write_json)
from featcal.signatures import run_sigmerge

RECORD_DIR = Path("results/merge")


def main() -> None:
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    method = get(params, "merge.method")
    options = dict(get(params, "merge.options", {}) or {})
    base_ref = get(params, "model.base")
    shutil.rmtree(RECORD_DIR, ignore_errors=True)
    with timed("merge"):
        record = {"method": method, "options": options}
        if method == "sigmerge":
            shared = int(options.pop("shared_examples_per_task", 16))
            bench = load_workbench(base_ref, {t: f"experts/{t}" for t in tasks}, get(params, "tasks_dir"),
                                   {t: max_length(params, t) for t in tasks}, int(get(params, "seed")))
            check_experts_fit_base(bench.base, bench.experts)   # what merge_models checks for the other methods
            merged, record = run_sigmerge(bench, options, shared)
            experts = bench.experts
            plot_admitted(record, RECORD_DIR / "admitted.png")
            save_multitask("models/merged", merged, experts, load_tokenizer(base_ref))
        elif streams(method, options):   # tensor group by tensor group: never a whole expert in memory
            check_model_types(base_ref, {t: f"experts/{t}" for t in tasks})
            with atomic_dir("models/merged") as tmp:
                lazy_merge(base_ref, {t: f"experts/{t}" for t in tasks}, method, options, tmp / "backbone")
                for item in (tmp / "backbone").iterdir():
                    os.replace(item, tmp / item.name)
                (tmp / "backbone").rmdir()
                save_heads(tmp, {t: load_head(f"experts/{t}") for t in tasks}, load_tokenizer(base_ref))
        else:
            experts = {t: load_classifier(f"experts/{t}") for t in tasks}
            merged = merge_models(load_backbone(base_ref), experts, method, options)
            save_multitask("models/merged", merged, experts, load_tokenizer(base_ref))
        write_json(RECORD_DIR / "record.json", record)
    print(f"merged {len(tasks)} experts with {method} -> models/merged")


if __name__ == "__main__":
    main()
