"""DVC stage `merge`: base + experts -> merged backbone (method and options from params.yaml)."""

from __future__ import annotations

from common import enabled_tasks, get, load_params, setup_logging, timed

from featcal import merge_models
from featcal.modeling import load_backbone, load_classifier, load_tokenizer, save_multitask


def main() -> None:
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    method = get(params, "merge.method")
    with timed("merge"):
        experts = {t: load_classifier(f"experts/{t}") for t in tasks}
        merged = merge_models(load_backbone(get(params, "model.base")), experts, method,
                              get(params, "merge.options", {}) or {})
        save_multitask("models/merged", merged, experts, load_tokenizer(get(params, "model.base")))
    print(f"merged {len(tasks)} experts with {method} -> models/merged")


if __name__ == "__main__":
    main()
