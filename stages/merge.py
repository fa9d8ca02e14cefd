"""DVC stage `merge`: base + experts -> merged backbone (method and options from params.yaml).

Every method that can is streamed from the checkpoints (`lazy_merge`, never a whole expert in
memory): the tensor-by-tensor methods, and RegMean, RegMean++ and AdaMerging with their train
batches (`DATA_MERGES`). SigMerge, which scores whole models on dev, runs in memory through
`merge_models`. `merge.options` may say how much data (`examples_per_task`,
`shared_examples_per_task`). What the method reports goes to --record/record.json, with its
figures (SigMerge: admitted.png).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from common import enabled_tasks, get, load_params, max_length, setup_logging, timed

from featcal.evaluation import compare as cmp
from featcal.io.checkpoints import load_head
from featcal.data.encoders import load_encoder
from featcal.io.models import atomic_dir, check_model_types, save_heads, save_multitask, write_json
from featcal.merging import get_method, split_options
from featcal.merging.in_memory import merge_models
from featcal.merging.lazy import DATA_MERGES, lazy_merge, streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", required=True, help="folder of the experts, one sub-folder per task")
    parser.add_argument("--out", required=True, help="where the merged multi-task model is written")
    parser.add_argument("--record", required=True, help="folder for what the method reports (record.json, figures)")
    args = parser.parse_args()
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    method = get(params, "merge.method")
    options, data = split_options(method, get(params, "merge.options", {}) or {})
    base_ref = get(params, "model.base")
    expert_dirs = {t: str(Path(args.experts) / t) for t in tasks}
    lengths = {t: max_length(params, t) for t in tasks}
    seed = int(get(params, "seed"))
    record_dir = Path(args.record)
    shutil.rmtree(record_dir, ignore_errors=True)
    with timed("merge"):
        record = {"method": method, "options": options, **({"data": data} if data else {})}
        if streams(method, options) or method in DATA_MERGES:   # never a whole expert in memory
            check_model_types(base_ref, expert_dirs)
            context = None
            if get_method(method).needs:   # train batches: the input encoder and the task data, no model
                task_data = cmp.TaskData(tasks, load_encoder(base_ref), get(params, "tasks_dir"), lengths, seed)
                context = cmp.merge_context(task_data, method, data, options)
            with atomic_dir(args.out) as tmp:
                lazy_merge(base_ref, expert_dirs, method, options, tmp / "backbone", context=context)
                for item in (tmp / "backbone").iterdir():
                    os.replace(item, tmp / item.name)
                (tmp / "backbone").rmdir()
                save_heads(tmp, {}, load_encoder(base_ref))
                for task, expert_dir in expert_dirs.items():   # one head in memory at a time (an untied LM
                    save_heads(tmp, {task: load_head(expert_dir)})   # head is vocabulary x hidden floats)
        else:
            bench = cmp.load_workbench(base_ref, expert_dirs, get(params, "tasks_dir"), lengths, seed)
            context = cmp.merge_context(bench, method, data, options)
            merged = merge_models(bench.base, bench.experts, method, options, context)
            save_multitask(args.out, merged, bench.experts, load_encoder(base_ref))   # a fresh one: the
            # workbench's tokenizer has been used with padding, which would change tokenizer.json
        if context is not None:
            record.update(context.record)
            report = get_method(method).report
            if report is not None:
                report(record, record_dir)
        write_json(record_dir / "record.json", record)
    print(f"merged {len(tasks)} experts with {method} -> {args.out}")


if __name__ == "__main__":
    main()
