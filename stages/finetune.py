"""DVC stage `finetune@<task>`: one expert per task (or a user's existing checkpoint, unchanged but
for the zero-shot head a CLIP tower gets with `model.zero_shot.text_model`)."""

from __future__ import annotations

import argparse

from common import get, live_log, load_params, log_step, max_length, setup_logging, timed
import torch

from featcal.data.splits import class_names, num_labels, read_split
from featcal.data.encoders import load_encoder
from featcal.data.spec import TaskSpec
from featcal.evaluation.language import split_nll
from featcal.io.models import atomic_dir, check_finite, is_causal_lm, load_classifier, write_json
from featcal.finetune import FinetuneConfig, accuracy, finetune
from featcal.finetune_lm import LoraSettings, finetune_lora

LOSS_EVERY = 10   # LoRA steps per logged train-loss point


def use_zero_shot_head(model, zero_shot: dict, classes: list[str]) -> None:
    """With `model.zero_shot.text_model`, the task's head is CLIP's zero-shot head on its class names."""
    if zero_shot["text_model"] is None:
        return
    from featcal.families.clip_zero_shot import DEFAULT_TEMPLATES, load_text_tower, zero_shot_weight

    text_model, tokenizer = load_text_tower(zero_shot["text_model"])
    model.use_zero_shot_head(zero_shot_weight(text_model, tokenizer, classes, zero_shot["templates"] or DEFAULT_TEMPLATES))


def language_model_expert(params: dict, task: str, base_ref: str, existing: str | None, encoder, length: int, live):
    """A language-model task's expert: the given causal LM, or a LoRA fine-tune of the base merged into
    its weights; scored by its mean token NLL on dev and test (lower is better)."""
    model = load_classifier(existing or base_ref)
    if not is_causal_lm(model):
        where = f"experts.paths.{task}" if existing else "model.base"
        raise SystemExit(f"tasks.{task}.objective is language_model, but {where} ({existing or base_ref}) is a "
                         f"{type(model).__name__}, not a causal LM")
    if not existing:
        settings = LoraSettings(max_length=length, seed=int(get(params, "seed")), **{
            k: tuple(v) if isinstance(v, list) else v for k, v in (get(params, "finetune.lm", {}) or {}).items()})
        texts = read_split(get(params, "tasks_dir"), task, "train").examples
        model, losses = finetune_lora(model, encoder, texts, settings, desc=f"lora {task}")
        for step in range(0, len(losses), LOSS_EVERY):
            window = losses[step:step + LOSS_EVERY]
            log_step(live, step, {"train_loss": sum(window) / len(window)})
    tasks_dir = get(params, "tasks_dir")
    return model, {f"{split}_nll": split_nll(model, encoder, read_split(tasks_dir, task, split), length)
                   for split in ("dev", "test")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", required=True)
    parser.add_argument("--out", required=True, help="where the expert's folder is written")
    parser.add_argument("--scores", required=True, help="where its dev/test accuracy (JSON) is written")
    parser.add_argument("--live", required=True, help="DVCLive folder: train loss and dev accuracy per epoch")
    args = parser.parse_args()
    task = args.task
    setup_logging()
    params = load_params()
    tasks_dir = get(params, "tasks_dir")
    base_ref = get(params, "model.base")
    existing = (get(params, "experts.paths", {}) or {}).get(task)
    with timed(f"finetune@{task}"), live_log(args.live) as live:
        encoder = load_encoder(base_ref)
        length = max_length(params, task)
        zero_shot = {"text_model": None, "templates": None, **(get(params, "model.zero_shot", None) or {})}
        n_labels = num_labels(tasks_dir, task)
        language_model = TaskSpec.from_mapping(task, get(params, f"tasks.{task}")).language_model
        if language_model:
            model, nll = language_model_expert(params, task, base_ref, existing, encoder, length, live)
            scores = {"dev": nll["dev_nll"], "test": nll["test_nll"], "score": "nll"}
        elif existing:
            # a CLIP tower given without a head gets its zero-shot head below
            model = load_classifier(existing, num_labels=n_labels if zero_shot["text_model"] else None)
            if model.config.num_labels != n_labels:
                raise SystemExit(f"experts.paths.{task}: {existing} has {model.config.num_labels} labels, "
                                 f"task {task!r} has {n_labels}")
            use_zero_shot_head(model, zero_shot, class_names(tasks_dir, task))
        else:
            settings = dict(get(params, "finetune"))
            overrides = settings.pop("overrides", {}) or {}
            settings.pop("lm", None)   # language-model tasks' LoRA settings
            settings.update(overrides.get(task, {}))
            config = FinetuneConfig(max_length=length, seed=int(get(params, "seed")), **settings)
            torch.manual_seed(config.seed)
            model = load_classifier(base_ref, num_labels=n_labels)
            use_zero_shot_head(model, zero_shot, class_names(tasks_dir, task))
            last: dict[str, float] = {}

            def log_epoch(epoch: int, metrics: dict[str, float]) -> None:
                last.update(metrics)
                log_step(live, epoch, metrics)

            model = finetune(model, encoder, read_split(tasks_dir, task, "train"), config,
                             dev=read_split(tasks_dir, task, "dev"), on_epoch=log_epoch)
        if not language_model:
            # the last epoch's dev accuracy is the final model's (its dev forwards leave the weights alone)
            dev = last["dev_accuracy"] if not existing else accuracy(model, encoder, read_split(tasks_dir, task, "dev"),
                                                                     length)
            scores = {"dev": dev, "test": accuracy(model, encoder, read_split(tasks_dir, task, "test"), length)}
            if existing:   # no epochs: the given model's dev accuracy, so the logger's outputs exist
                log_step(live, 0, {"dev_accuracy": dev})
        check_finite(model.state_dict(), f"refusing to write {args.out}: the {'given' if existing else 'fine-tuned'} model")
        with atomic_dir(args.out) as tmp:
            model.save_pretrained(tmp)
            encoder.save_pretrained(tmp)
        write_json(args.scores, {"task": task, "source": existing or "finetuned", **scores})
    print(f"{task}: dev {scores['dev']:.3f} test {scores['test']:.3f}")


if __name__ == "__main__":
    main()
