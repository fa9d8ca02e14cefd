"""DVC stage `merge`: base + experts -> merged backbone (method and options from params.yaml).

A method that acts tensor group by tensor group is streamed from the checkpoints (`lazy_merge`,
never a whole expert in memory). Any other runs in memory through `merge_models`, with the context
its registry entry declares (train batches, dev scores, shared examples) built from the task data;
`merge.options` may say how much data (`examples_per_task`, `shared_examples_per_task`). What the
method reports goes to results/merge/record.json, with its figures (SigMerge: admitted.png).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common import enabled_tasks, get, load_params, max_length, setup_logging, timed

from featcal import merge_models
from featcal.evaluation.compare import load_workbench, merge_context
from featcal.merging.lazy import lazy_merge, streams
from featcal.io.checkpoints import load_head
from featcal.merging import get_method, split_options
from featcal.io.models import atomic_dir, check_model_types, load_tokenizer, save_heads, save_multitask, write_json

RECORD_DIR = Path("results/merge")


def main() -> None:
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    method = get(params, "merge.method")
    options, data = split_options(method, get(params, "merge.options", {}) or {})
    base_ref = get(params, "model.base")
    expert_dirs = {t: f"experts/{t}" for t in tasks}
    shutil.rmtree(RECORD_DIR, ignore_errors=True)
    with timed("merge"):
        record = {"method": method, "options": options, **({"data": data} if data else {})}
        if streams(method, options):   # tensor group by tensor group: never a whole expert in memory
            check_model_types(base_ref, expert_dirs)
            with atomic_dir("models/merged") as tmp:
                lazy_merge(base_ref, expert_dirs, method, options, tmp / "backbone")
                for item in (tmp / "backbone").iterdir():
                    os.replace(item, tmp / item.name)
                (tmp / "backbone").rmdir()
                save_heads(tmp, {t: load_head(d) for t, d in expert_dirs.items()}, load_tokenizer(base_ref))
        else:
            bench = load_workbench(base_ref, expert_dirs, get(params, "tasks_dir"),
                                   {t: max_length(params, t) for t in tasks}, int(get(params, "seed")))
            context = merge_context(bench, method, data)
            merged = merge_models(bench.base, bench.experts, method, options, context)
            save_multitask("models/merged", merged, bench.experts, load_tokenizer(base_ref))   # a fresh one: the
            # workbench's tokenizer has been used with padding, which would change tokenizer.json
            record.update(context.record)
            report = get_method(method).report
            if report is not None:
                report(record, RECORD_DIR)
        write_json(RECORD_DIR / "record.json", record)
    print(f"merged {len(tasks)} experts with {method} -> models/merged")


if __name__ == "__main__":
    main()
