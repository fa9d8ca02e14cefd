"""Benchmark (not a test): what one LoRA step costs on the real 1.5B decoder, to size llm/'s experts.

Loads the base of llm/params.yaml (`make setup-llm`), fine-tunes a few steps with llm/'s `finetune.lm`
settings (or --layers / --batch-size / --max-length) on scikit-learn's source (the code domain) and
prints the seconds per step (the adapters' merge included), the load time and the peak RSS.

    .venv/bin/python bench/lora_cost.py --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=ROOT / "llm/params.yaml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=str, default=None, help="e.g. 20-27, or all")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=None)
    args = parser.parse_args()
    from featcal.data.corpora import load_python_source
    from featcal.data.encoders import load_encoder
    from featcal.finetune_lm import LoraSettings, finetune_lora
    from featcal.io.models import load_classifier
    from featcal.profiling import measure

    params = yaml.safe_load(args.params.read_text())
    lm = {k: tuple(v) if isinstance(v, list) else v for k, v in params["finetune"]["lm"].items()}
    settings = LoraSettings(max_length=params["tokens"]["max_length"], **lm)
    if args.layers:
        low, _, high = args.layers.partition("-")
        settings = dataclasses.replace(settings, layers=None if args.layers == "all" else
                                       tuple(range(int(low), int(high or low) + 1)))
    settings = dataclasses.replace(settings, steps=args.steps, batch_size=args.batch_size or settings.batch_size,
                                   max_length=args.max_length or settings.max_length)
    texts = list(load_python_source("sklearn", 40)["text"][: settings.steps * settings.batch_size])
    with measure() as run:
        start = time.perf_counter()
        model = load_classifier(params["model"]["base"])
        encoder = load_encoder(params["model"]["base"])
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        model, losses = finetune_lora(model, encoder, texts, settings, progress=False)
        train_s = time.perf_counter() - start
    per_step = train_s / settings.steps
    print(json.dumps({"threads": torch.get_num_threads(), "load_s": round(load_s, 1), "steps": settings.steps,
                      "train_s": round(train_s, 1), "s_per_step_incl_merge": round(per_step, 1),
                      "layers": settings.layers, "batch_size": settings.batch_size, "max_length": settings.max_length,
                      "target_modules": settings.target_modules, "peak_rss_mib": round(run.peak_rss_mib),
                      "losses": [round(x, 3) for x in losses]}, indent=1))


if __name__ == "__main__":
    main()
