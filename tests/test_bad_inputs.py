"""Every bad input gets a clear error (naming the key, file or task), and nothing wrong is trusted.

Through the real entry points: the stages' params loading (`stages/common.load_params`, what every
stage runs first), `stages/prepare.py`, the Python API (`merge_models`, loading and saving models),
the tune stage's command line and the study plumbing, and — for what only a real pipeline shows — `dvc repro`
and `dvc exp run` on one shared tiny project: nothing is recorded in dvc.lock when a stage refuses.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest
import torch
import yaml
from optuna.trial import TrialState
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2Model, RobertaConfig, RobertaForSequenceClassification

from featcal import merge_models
from featcal import tuning as tune
from featcal.io.models import (ImplausibleExpertWarning, NonFiniteWeightsError, load_backbone, load_classifier,
                              save_multitask)
from featcal.io.feature_store import write_group
from conftest import DVC, copy_project, tiny_bert
from tiny_project import ROOT, make_base, make_tasks, run, tiny_params

sys.path.insert(0, str(ROOT / "stages"))
import common  # noqa: E402  (stages/common.py: what every stage runs first)
import gen_chain  # noqa: E402
import prepare  # noqa: E402

def tiny_bert_classifier(seed: int = 0, hidden: int = 32, layers: int = 2):
    """The tiny project's base size (tests/tiny_project.py: 19 tokens, hidden 32) as a classifier."""
    return tiny_bert(seed, layers=layers, vocab=19, hidden=hidden, intermediate=64, positions=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer BERT base, two synthetic tasks, their params, and models of other types."""
    root = tmp_path_factory.mktemp("bad_inputs")
    make_base(root / "base")
    params = tiny_params(root / "base", make_tasks(root / "raw"))
    torch.manual_seed(0)
    roberta = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=19, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66))
    roberta.save_pretrained(root / "roberta")
    GPT2Model(GPT2Config(vocab_size=19, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(root / "gpt2")
    make_base(root / "base3", layers=3)
    chain = write_chain(root / "chain", params)
    return SimpleNamespace(root=root, params=params, chain=chain)


def write_chain(folder: Path, params: dict) -> Path:
    """stages/chain.yaml for `params`, written by stages/gen_chain.py itself."""
    (folder / "stages").mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    argv = sys.argv
    sys.argv = ["gen_chain.py", "--params", str(folder / "params.yaml"), "--out", str(folder / "stages/chain.yaml")]
    try:
        gen_chain.main()
    finally:
        sys.argv = argv
    return folder / "stages/chain.yaml"


def refused(tiny, tmp_path, edit, chain: Path | None = None) -> str:
    """The one-line error with which a stage stops on the tiny params changed by `edit`."""
    params = copy.deepcopy(tiny.params)
    edit(params)
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages/chain.yaml").write_bytes((chain or tiny.chain).read_bytes())
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(SystemExit) as err:
        common.load_params(path, check_chain=True)
    message = str(err.value.code)
    assert isinstance(err.value.code, str) and message.startswith(str(path)), message   # exit status 1
    return message


def setter(dotted: str, value):
    def edit(params):
        *parents, last = dotted.split(".")
        node = params
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return edit


# --- params: typos, types, ranges (silently wrong or unclear before) ------------------------------------


PARAM_CASES = [
    # (key set, value, what the message must say)
    ("merge.optoins", {"scale": 0.3}, ["merge.optoins", "did you mean 'options'"]),
    ("tokens.per_tsk", {"sentiment": 8}, ["tokens.per_tsk", "did you mean 'per_task'"]),
    ("experts.paths", {"sentimnt": "x"}, ["experts.paths.sentimnt", "unknown task", "did you mean 'sentiment'"]),
    ("tokens.per_task", {"topc": 8}, ["tokens.per_task.topc", "did you mean 'topic'"]),
    ("finetune.overrides", {"topic": {"epocs": 1}}, ["finetune.overrides.topic.epocs", "did you mean 'epochs'"]),
    ("seeed", 1, ["seeed", "did you mean 'seed'"]),
    ("featcal.alpah", 0.3, ["featcal.alpah", "did you mean 'alpha'"]),
    ("featcal.alpha", -1, ["featcal.alpha = -1", "[0, 1]"]),
    ("featcal.alpha", 2, ["featcal.alpha = 2", "[0, 1]"]),
    ("featcal.alpha", float("nan"), ["featcal.alpha = nan", "finite"]),
    ("featcal.alpha", "abc", ["featcal.alpha = 'abc'", "a finite number"]),
    ("featcal.rho", -1, ["featcal.rho = -1", "> 0"]),
    ("featcal.ridge", -0.5, ["featcal.ridge = -0.5", ">= 0"]),
    ("featcal.calibrate_bias", "yes", ["featcal.calibrate_bias = 'yes'", "true or false"]),
    ("featcal.layer_overrides", {5: {"alpha": 0.5}}, ["featcal.layer_overrides.5", "2 blocks, 0..1"]),
    ("featcal.layer_overrides", {1: {"alpha": 1.5}}, ["featcal.layer_overrides.1.alpha = 1.5", "[0, 1]"]),
    ("calibration.examples_per_task", 0, ["calibration.examples_per_task = 0", ">= 1"]),
    ("calibration.batch_size", 0, ["calibration.batch_size = 0", ">= 1"]),
    ("tokens.max_length", 0, ["tokens.max_length = 0", ">= 1"]),
    ("tokens.max_length", 512, ["tokens.max_length = 512", "only 64 positions"]),
    ("finetune.learning_rate", 0, ["finetune.learning_rate = 0", "> 0"]),
    ("evaluate.drift_examples_per_task", 0, ["evaluate.drift_examples_per_task = 0", ">= 1"]),
    ("tune.n_trials", -3, ["tune.n_trials = -3", ">= 1"]),
    ("tune.search", {"alpha": [0, 2]}, ["tune.search.alpha.high = 2", "[0, 1]"]),
    ("tune.search", {"alpha@1": [0, 2]}, ["tune.search.alpha@1.high = 2", "[0, 1]"]),
    ("tune.search", {"alpha@5": [0, 1]}, ["tune.search.alpha@5", "2 blocks, 0..1"]),
    ("tune.search", {"alhpa@0": [0, 1]}, ["tune.search.alhpa@0", "did you mean 'alpha'", "KEY@BLOCK"]),
    ("tune.prune_after_layers", [1], ["tune.prune_after_layers[0] = 1", "blocks 0..0"]),
    ("tune.anchor_search", {"scael": [0.1, 1.0]}, ["tune.anchor_search", "'scael'", "scale"]),
    ("merge.method", "tiez", ["merge.method = 'tiez'", "did you mean 'ties'"]),
    ("merge.options", {"scael": 0.3}, ["merge.options", "'scael'", "scale"]),
    ("parallel.nproc_per_node", 0, ["parallel.nproc_per_node = 0", ">= 1"]),
    ("cache.dtype", "float8", ["cache.dtype = 'float8'", "float32, bfloat16, float16"]),
    ("cache.compressor", "lz4", ["cache.compressor = 'lz4'", "none, zstd, gzip"]),
    ("compare.corruptions", ["typo"], ["compare.corruptions[0] = 'typo'", "did you mean 'typos'"]),
    ("compare.surgery", {"iteratons": 5}, ["compare.surgery.iteratons", "did you mean 'iterations'"]),
    ("compare.featcal", {"product_dtype": "float32"}, ["compare.featcal.product_dtype", "known keys: alpha, calibrate_pooler, rho, ridge"]),
    ("compare.featcal", {"alpha": 1.5}, ["compare.featcal.alpha = 1.5", "[0, 1]"]),
]


@pytest.mark.parametrize("key, value, says", PARAM_CASES, ids=[f"{c[0]}={c[1]!r}" for c in PARAM_CASES])
def test_bad_params_value_stops_the_stage_naming_key_value_and_allowed(tiny, tmp_path, key, value, says):
    message = refused(tiny, tmp_path, setter(key, value))
    for part in says:
        assert part in message, message


def test_task_spec_typo_names_the_task_and_suggests_the_key(tiny, tmp_path):
    message = refused(tiny, tmp_path, lambda p: p["tasks"]["topic"].update(sorce="file:x.csv"))
    assert "tasks.topic" in message and "'sorce'" in message and "did you mean 'source'" in message


def test_no_enabled_task_is_refused(tiny, tmp_path):
    message = refused(tiny, tmp_path, lambda p: [spec.update(enabled=False) for spec in p["tasks"].values()])
    assert "tasks" in message and "no enabled task" in message


def test_password_in_a_storage_url_is_refused_and_not_echoed(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("tune.storage", "postgresql://me:s3cret@db.example/featcal"))
    assert "tune.storage" in message and "~/.pgpass" in message and "s3cret" not in message


def test_password_in_any_url_of_params_is_refused(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("experts.paths", {"topic": "https://me:s3cret@hub.example/m"}))
    assert "experts.paths.topic" in message and "password" in message and "s3cret" not in message


# --- params against the models and the generated chain ---------------------------------------------------


def test_missing_base_path_names_the_path_not_a_hub_repo_id(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("model.base", str(tmp_path / "no/such/model")))
    assert "model.base" in message and "no such file or folder" in message and "Repo id" not in message


def test_unsupported_base_family_names_its_type_and_the_supported_ones(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("model.base", str(tiny.root / "gpt2")))
    assert "model.base" in message and "'gpt2'" in message and "bert" in message and "llama" in message


def test_missing_expert_path_names_the_task_key_and_path(tiny, tmp_path):
    missing = str(tmp_path / "experts/gone")
    message = refused(tiny, tmp_path, setter("experts.paths", {"topic": missing}))
    assert "experts.paths.topic" in message and missing in message and "Repo id" not in message


def test_expert_of_another_model_type_names_both_types(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("experts.paths", {"topic": str(tiny.root / "roberta")}))
    assert "experts.paths.topic" in message and "'roberta'" in message and "'bert'" in message


def test_new_task_without_regenerated_chain_says_run_gen_chain(tiny, tmp_path):
    extra = {"source": tiny.params["tasks"]["topic"]["source"]}
    message = refused(tiny, tmp_path, lambda p: p["tasks"].update(extra_task=extra))
    assert "chain.yaml is stale" in message and "extra_task" in message and "python stages/gen_chain.py" in message


def test_deeper_base_without_regenerated_chain_says_run_gen_chain(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("model.base", str(tiny.root / "base3")))
    assert "chain.yaml is stale" in message and "3 blocks" in message and "python stages/gen_chain.py" in message


def test_use_tuned_switched_without_regenerated_chain_says_run_gen_chain(tiny, tmp_path):
    message = refused(tiny, tmp_path, setter("featcal.use_tuned", True))
    assert "featcal_params" in message and "tune/best.yaml" in message and "gen_chain.py" in message


def test_tuned_values_out_of_range_are_refused(tmp_path):
    best = tmp_path / "best.yaml"
    best.write_text(yaml.safe_dump({"featcal": {"alpha": 1.7, "rho": 2.2, "ridge": 0.05}, "study": {"name": "s"}}))
    with pytest.raises(SystemExit, match=r"best\.yaml: featcal\.alpha = 1\.7: .*\[0, 1\]"):
        common.load_params(best)


def test_good_params_pass_and_keep_get_working(tiny, tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages/chain.yaml").write_bytes(tiny.chain.read_bytes())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny.params, sort_keys=False))
    params = common.load_params(tmp_path / "params.yaml", check_chain=True)
    assert common.get(params, "featcal.alpha") == tiny.params["featcal"]["alpha"]
    assert common.enabled_tasks(params) == ["sentiment", "topic"]


# --- task data -----------------------------------------------------------------------------------------------


def prepare_task(tmp_path, monkeypatch, frame_or_text, suffix: str = ".csv", **spec) -> Path:
    """Run stages/prepare.py (as a user outside DVC) on one file task; returns the output folder."""
    monkeypatch.delenv("DVC_STAGE", raising=False)
    source = tmp_path / f"source{suffix}"
    if isinstance(frame_or_text, str):
        source.write_text(frame_or_text)
    else:
        frame_or_text.to_parquet(source)
    task = {"source": f"file:{source}", "max_train": 40, "n_dev": 6, "n_test": 6, **spec}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"tasks": {"toy": task}}))
    prepare.main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "out")])
    return tmp_path / "out" / "toy"


def test_one_class_task_is_refused_naming_task_file_and_class(tmp_path, monkeypatch):
    rows = "".join(f"text number {i},pos\n" for i in range(40))
    with pytest.raises(SystemExit) as err:
        prepare_task(tmp_path, monkeypatch, "text,label\n" + rows)
    assert "'toy'" in str(err.value) and "source.csv" in str(err.value) and "'pos'" in str(err.value)
    assert "at least two classes" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_labels_1_and_1_0_are_one_class_and_the_mapping_is_in_labels_json(tmp_path, monkeypatch):
    labels = ["0", "0.0", "1", "1.0", " 1 "] * 10           # a string column, as parquet or hf sources keep it
    frame = pd.DataFrame({"text": [f"example {i}" for i in range(len(labels))], "label": labels})
    out = prepare_task(tmp_path, monkeypatch, frame, suffix=".parquet")
    record = json.loads((out / "labels.json").read_text())
    assert record["classes"] == ["0", "1"]
    assert record["raw_labels"] == {"0": "0", "0.0": "0", "1": "1", "1.0": "1"}
    assert set(pd.read_parquet(out / "train.parquet")["label"]) == {0, 1}


def test_na_none_null_texts_are_kept_as_text(tmp_path, monkeypatch):
    words = ["NA", "None", "null", "N/A", "nan"]
    rows = "".join(f"{w},{i % 2}\n" for i, w in enumerate(words)) + "".join(f"row {i},{i % 2}\n" for i in range(40))
    out = prepare_task(tmp_path, monkeypatch, "text,label\n" + rows)
    texts = set().union(*(set(pd.read_parquet(out / f"{s}.parquet")["text"]) for s in ("train", "dev", "test")))
    assert set(words) <= texts


def test_dropped_rows_are_counted_per_reason(tmp_path, monkeypatch, caplog):
    rows = ",a\n" + "only spaces   ,a\n".replace("only spaces", "  ") + "no label,\n" + "skip me,c\n"
    rows += "".join(f"row {i},{'ab'[i % 2]}\n" for i in range(40))
    with caplog.at_level("INFO", logger="featcal.data.tasks"):
        out = prepare_task(tmp_path, monkeypatch, "text,label\n" + rows, label_map={"a": "A", "b": "B", "c": None})
    dropped = json.loads((out / "labels.json").read_text())["dropped"]
    assert dropped == {"missing text": 1, "missing label": 1, "label mapped to null": 1, "empty text": 1}
    assert any("toy" in r.message and "missing label 1" in r.message for r in caplog.records)


def test_label_map_keys_that_normalise_alike_are_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"tasks\.toy\.label_map.*'1'"):
        prepare_task(tmp_path, monkeypatch, "text,label\nx,1\n", label_map={1: "one", "1.0": "uno"})


# --- weights where they enter and leave -------------------------------------------------------------------


def test_checkpoint_with_nan_names_file_and_tensor(tmp_path):
    tiny_bert_classifier().save_pretrained(tmp_path / "expert")
    file = tmp_path / "expert/model.safetensors"
    tensors = load_file(file)
    key = next(k for k in tensors if k.endswith("layer.1.output.dense.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError) as err:
        load_classifier(str(tmp_path / "expert"))
    assert str(file) in str(err.value) and repr(key) in str(err.value) and "1 NaN" in str(err.value)
    with pytest.raises(NonFiniteWeightsError, match=re.escape(str(file))):
        load_backbone(str(tmp_path / "expert"))


def test_a_masked_lm_given_as_an_expert_is_refused_not_given_a_random_head(tmp_path, caplog):
    """`experts.paths` naming a BertForMaskedLM: loaded as a classifier it got a random head and pooler
    and was used as an expert. A base model fine-tuning starts from gets its new head said in one line,
    without transformers' load report."""
    from transformers import BertConfig, BertForMaskedLM

    classifier = tiny_bert_classifier()
    BertForMaskedLM(BertConfig(**{k: v for k, v in classifier.config.to_dict().items()
                                  if k in BertConfig().to_dict()})).save_pretrained(tmp_path / "mlm")
    with pytest.raises(ValueError, match=r"mlm: not a fine-tuned BertForSequenceClassification: 4 of its tensors are "
                                         r"not in the checkpoint \(bert.pooler.dense.bias, .*the checkpoint is a "
                                         r"BertForMaskedLM\); an expert must hold its own trained head"):
        load_classifier(str(tmp_path / "mlm"))
    classifier.bert.save_pretrained(tmp_path / "base")   # a bare backbone: fine-tuning starts here
    # transformers' loggers do not propagate to the root (caplog), and its handler holds the stream it was
    # made with (not what capfd reads): what they say is collected on transformers' own logger
    said = []
    collect = logging.Handler(logging.DEBUG)
    collect.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(collect)
    try:
        with caplog.at_level("INFO"):
            model = load_classifier(str(tmp_path / "base"), num_labels=3)
    finally:
        logging.getLogger("transformers").removeHandler(collect)
    assert model.config.num_labels == 3
    assert "a new 3-label head (classifier.bias, classifier.weight not in the checkpoint" in caplog.text
    # no load report, and no "layers were not sharded" (a tensor-parallel check the report's quieting set off)
    assert not [m for m in said if "LOAD REPORT" in m or "not sharded" in m], said


def test_missing_local_expert_path_is_not_a_hub_error(tmp_path):
    for ref in (str(tmp_path / "experts/gone"), "experts/gone"):
        with pytest.raises(FileNotFoundError, match=re.escape(repr(ref))) as err:
            load_classifier(ref)
        assert "Repo id" not in str(err.value)


def test_merge_refuses_an_expert_with_inf_weights_naming_it_and_the_tensor():
    base = tiny_bert_classifier()
    bad = copy.deepcopy(base)
    with torch.no_grad():
        bad.bert.encoder.layer[0].intermediate.dense.weight[3, 3] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match=r"expert 'b'.*encoder\.layer\.0\.intermediate\.dense\.weight.*1 infinite"):
        merge_models(base, {"a": copy.deepcopy(base), "b": bad})


def test_merge_refuses_an_expert_of_another_family_naming_both():
    torch.manual_seed(0)
    roberta = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=19, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66))
    with pytest.raises(ValueError, match=r"expert 'b' is a 'roberta' model.*the base is a 'bert' model"):
        merge_models(tiny_bert_classifier(), {"a": tiny_bert_classifier(), "b": roberta})


def test_merge_refuses_an_expert_of_another_size_naming_task_and_tensor():
    with pytest.raises(ValueError, match=r"expert 'wide': tensor 'embeddings\.word_embeddings\.weight' has shape"):
        merge_models(tiny_bert_classifier(), {"wide": tiny_bert_classifier(hidden=48)})


def test_an_expert_with_more_layers_than_the_base_is_refused_naming_it(tmp_path):
    """It holds every tensor of the base (and more), so the tensor-by-tensor check passed it and a
    later step failed naming a healthy expert; in memory and where the merge reads checkpoints lazily."""
    from featcal.io.models import check_model_types

    base, deep = tiny_bert_classifier(), tiny_bert_classifier(layers=3)
    with pytest.raises(ValueError, match=r"expert 'deep': its num_hidden_layers is 3, the base's is 2; experts must "
                                         r"be fine-tuned from the base"):
        merge_models(base, {"fine": tiny_bert_classifier(), "deep": deep})
    base.save_pretrained(tmp_path / "base")
    deep.save_pretrained(tmp_path / "deep")
    with pytest.raises(ValueError, match=r"expert 'deep' \(.*deep\): its num_hidden_layers is 3, the base's is 2"):
        check_model_types(str(tmp_path / "base"), {"deep": str(tmp_path / "deep")})


def test_expert_not_fine_tuned_from_the_base_warns_with_expert_and_ratio():
    base = tiny_bert_classifier(seed=0)
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    with pytest.warns(ImplausibleExpertWarning, match=r"expert 'random': its task vector is 1\.\d\d times") as caught:
        merge_models(base, {"tuned": tuned, "random": tiny_bert_classifier(seed=7)})
    assert not any("'tuned'" in str(w.message) for w in caught)


def test_nothing_is_written_when_the_model_holds_nan(tmp_path):
    model = tiny_bert_classifier()
    with torch.no_grad():
        model.bert.pooler.dense.bias[0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"refusing to write .*out.*pooler\.dense\.bias"):
        save_multitask(tmp_path / "out", model.bert, {"a": model})
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_temporary_folders_of_a_killed_writer_are_removed_by_the_next_write(tmp_path):
    dead = tmp_path / ".layer_01.zarr.tmp4194999-abc"        # above pid_max: that process is gone
    live = tmp_path / f".layer_01.zarr.tmp{os.getpid()}-xyz"  # a writer still running: kept
    dead.mkdir()
    live.mkdir()
    write_group(tmp_path / "layer_01.zarr", {"a": torch.zeros(3, 2)})
    assert not dead.exists() and live.exists() and (tmp_path / "layer_01.zarr/zarr.json").exists()


# --- tuning -------------------------------------------------------------------------------------------------


KILLED_WORKER = textwrap.dedent("""
    import sys, time
    from featcal import tuning as tune
    url = sys.argv[1]
    study = tune.open_study(url, "killed")
    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        if trial.number == 1:
            print("in trial 1", flush=True)
            time.sleep(600)
        return x
    tune.run_trials(study, objective, 3, lock=tune.ClaimLock(url, "killed"))
""")


def test_a_killed_workers_trial_is_never_counted_complete(tmp_path):
    url = f"sqlite:///{tmp_path / 'tune/study.db'}"
    worker = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, url], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    assert worker.stdout.readline().strip() == "in trial 1"
    os.kill(worker.pid, signal.SIGKILL)                      # kill -9 mid-trial: no heartbeat grace has passed
    worker.wait(timeout=30)
    study = tune.open_study(url, "killed")
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE, TrialState.RUNNING]
    ran = tune.run_trials(study, lambda t: t.suggest_float("x", 0, 1), 3, lock=tune.ClaimLock(url, "killed"))
    trials = study.get_trials()
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["dead_worker"] is True
    assert ran == [2, 3] and sum(t.state == TrialState.COMPLETE for t in trials) == 3


def tune_stage(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python stages/tune.py ARGS` (the DVC stage, and the command of more workers) run in `cwd`."""
    return subprocess.run([sys.executable, str(ROOT / "stages/tune.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("content, says", [(b"", "is empty"), (b"\x00garbage" * 100, "not a sqlite database")])
def test_empty_or_damaged_study_file_is_refused_naming_file_and_fix(tiny, tmp_path, content, says):
    study = tmp_path / "tune/study.db"
    study.parent.mkdir()
    study.write_bytes(content)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny.params))
    done = tune_stage("--params", "params.yaml", "--storage", f"sqlite:///{study}", cwd=tmp_path)
    err = done.stderr
    assert done.returncode != 0 and str(study) in err and says in err and "dvc checkout" in err and "delete it" in err
    assert "Traceback" not in err
    assert study.read_bytes() == content                     # not replaced by a fresh study


def study_with_dev(tmp_path: Path, name: str = "s") -> str:
    """Three complete trials recording their per-task dev scores as the objective does (value = their mean)."""
    url = f"sqlite:///{tmp_path / 'tune/study.db'}"

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        dev = {"a": round(0.5 * x, 6), "b": round(0.5 * x, 6)}
        trial.set_user_attr("dev", dev)
        return sum(dev.values()) / 2

    tune.run_trials(tune.open_study(url, name), objective, 3)
    return url


def test_a_changed_trial_value_in_the_study_file_is_refused_not_taken_for_the_best(tmp_path):
    """One trial's stored value changed (a flipped bit passes SQLite's own integrity check): its value
    no longer is the mean of its recorded dev scores, and it must not become the study's best."""
    import sqlite3

    url = study_with_dev(tmp_path)
    with sqlite3.connect(tmp_path / "tune/study.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        db.execute("UPDATE trial_values SET value = 0.75 WHERE trial_id = (SELECT MIN(trial_id) FROM trials)")
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    study = optuna.load_study(study_name="s", storage=url)
    assert study.best_trial.value == 0.75                     # what the damage would have chosen
    from featcal import FeatCalConfig

    for read in (tune.summarize, lambda st: tune.best_values(st, FeatCalConfig())):
        with pytest.raises(tune.StudyStorageError, match=r"study\.db: study 's', trial 0: its value 0\.75 is not the "
                                                         r"mean of the dev scores it recorded .*cannot be trusted"):
            read(study)


def test_overwritten_bytes_or_a_lock_on_the_study_file_are_said_in_one_line(tmp_path):
    """512 overwritten bytes gave a bare traceback; a file locked by another process was called
    unreadable after the timeout, with advice to delete it."""
    import sqlite3

    from featcal import FeatCalConfig

    url = study_with_dev(tmp_path)
    path = tmp_path / "tune/study.db"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, sys, time
        db = sqlite3.connect({str(path)!r}, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(tune.StudyStorageError, match=r"is locked by another process.*do not delete it") as err:
            tune.tune(SimpleNamespace(fingerprint=lambda *a: None, dev={}, n_blocks=1), FeatCalConfig(), tune.SearchSpace(),
                      url, "s", 4)
        assert "delete it to start" not in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    data = bytearray(path.read_bytes())
    data[4096:4608] = bytes(range(256)) * 2   # the start of the second page
    path.write_bytes(bytes(data))
    with pytest.raises(tune.StudyStorageError, match=r"study file .*study\.db cannot be read .*restore it"):
        tune.summarize(tune.open_study(url, "s"))


@pytest.mark.parametrize("metrics, says", [
    ('{"experts": {"avg": 0.7, "a": 0.7}, "featcal": {"avg": 94.723, "a": 94.723}}',
     "metrics.json: featcal.avg = 94.723: an accuracy must be a number in [0, 1]"),
    ('{"experts": {"avg": NaN, "a": 0.5}}', "metrics.json: experts.avg = nan: an accuracy must be a number in [0, 1]"),
    ('{"experts": {"avg": 0.7, "a": "high"}}', "metrics.json: experts.a = 'high'"),
    ('{"experts": {"avg": 0.7', "metrics.json: not valid JSON"),
    ('[1, 2]', "metrics.json: expected a JSON object, got list"),
])
def test_make_report_refuses_a_malformed_or_out_of_range_results_file_naming_it(tmp_path, metrics, says):
    """A bare traceback before, or scores shown as 9472.3 % and nan without complaint."""
    (tmp_path / "metrics.json").write_text(metrics)
    done = subprocess.run([sys.executable, str(ROOT / "stages/report.py"), "--metrics", str(tmp_path / "metrics.json"),
                           "--plots", str(tmp_path), "--out", str(tmp_path / "report.html")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "report: error:" in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "report.html").exists()


def test_a_flipped_bit_in_a_stores_metadata_names_the_store_and_the_damage(tmp_path):
    """zarr's metadata (zarr.json) carries no checksum: a flipped bit gave a bare JSONDecodeError, or a
    valid JSON of another shape. Each array's zarr.json is sealed in the group's attrs at write time."""
    from featcal.io.feature_store import read_attrs, read_group

    def store_with_flip(store: Path, meta: str, at: bytes, after: bytes, bit: int) -> Path:
        write_group(store, {"x/a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}, {"layer": 0})
        data = bytearray((store / meta).read_bytes())
        data[data.index(at, data.index(after))] ^= bit
        (store / meta).write_bytes(bytes(data))
        return store

    broken = store_with_flip(tmp_path / "layer_00.zarr", "zarr.json", b"{", b"", 0x01)    # '{' -> 'z': no JSON
    for read in (read_group, read_attrs):
        with pytest.raises(OSError, match=r"layer_00\.zarr: its metadata zarr\.json cannot be read .*the cache is damaged"):
            read(broken)
    reshaped = store_with_flip(tmp_path / "layer_01.zarr", "x/a/zarr.json", b"3", b'"shape"', 0x0A)  # 3 rows -> 9
    assert json.loads((reshaped / "x/a/zarr.json").read_text())["shape"][0] == 9    # still valid JSON
    with pytest.raises(OSError, match=r"layer_01\.zarr: the metadata x/a/zarr\.json is missing or not as written"):
        read_group(reshaped)
    assert read_attrs(store_with_flip(tmp_path / "ok.zarr", "b/zarr.json", b"{", b"", 0)) == {"layer": 0}


def test_the_calibrate_stages_refuse_cuda_where_there_is_none(monkeypatch, tmp_path):
    """featcal.device: cuda on a machine without CUDA: the per-layer stages never read the setting, ran
    on the CPU and exited 0; now the step refuses it before reading anything, as in process."""
    from featcal import FeatCalConfig
    from featcal.calibration.layerwise import calibrate_cached_layer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"featcal.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'"):
        calibrate_cached_layer(0, tmp_path / "merged", tmp_path / "base", {}, {}, None, lambda layer: {},
                               FeatCalConfig(device="cuda"))


def test_tune_stage_refuses_n_trials_below_one(tmp_path):
    done = tune_stage("--n-trials", "-3", cwd=tmp_path)
    assert done.returncode == 2 and "--n-trials" in done.stderr


def test_tune_anchor_refuses_zero_trials_instead_of_running_the_default_study(tmp_path):
    """`--n-trials 0` used to read as "not given": a full 24-trial study, test read once."""
    done = subprocess.run([sys.executable, str(ROOT / "stages/tune_anchor.py"), "task_arithmetic", "--n-trials", "0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--n-trials: expected an integer >= 1, got 0" in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())   # nothing merged, no study


@pytest.mark.parametrize("kwargs, says", [
    ({"alpha": "0.3"}, "featcal.alpha must be a number, got '0.3' (str)"),
    ({"ridge": True}, "featcal.ridge must be a number, got True (bool)"),
    ({"calibrate_pooler": "yes"}, "featcal.calibrate_pooler must be true or false, got 'yes'"),
    ({"layer_overrides": {1: {"rho": "2"}}}, "featcal.layer_overrides[1].rho must be a number, got '2'"),
])
def test_featcal_config_names_a_value_of_the_wrong_type(kwargs, says):
    """Through the Python API (`FeatCalConfig(alpha='0.3')` raised a TypeError naming no key)."""
    from featcal import FeatCalConfig

    with pytest.raises(TypeError, match=re.escape(says)):
        FeatCalConfig(**kwargs)


def test_calibrate_refuses_an_override_of_a_missing_layer_and_raw_text_batches_and_warns_of_unmasked_padding(caplog):
    """Through the Python API: `layer_overrides` for a block the model lacks was ignored; batches of
    raw strings raised an AttributeError; padded batches without an attention mask were calibrated
    on their pad positions without a word."""
    from conftest import batches_for, perturbed
    from featcal import FeatCalConfig, calibrate

    base = tiny_bert(layers=2)
    experts = {t: perturbed(base, i + 1, scale=0.01) for i, t in enumerate("ab")}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    batches = batches_for(experts)
    with pytest.raises(ValueError, match=r"featcal.layer_overrides: no layer 2 in this model; its calibrated layers are 0..1"):
        calibrate(merged, base, experts, batches, FeatCalConfig(layer_overrides={2: {"alpha": 0.5}}), progress=False)
    with pytest.raises(ValueError, match=r"no layer 3 in this model; its calibrated layers are 0..2"):   # 2: the pooler
        calibrate(merged, base, experts, batches, FeatCalConfig(calibrate_pooler=True, layer_overrides={3: {"rho": 1.0}}),
                  progress=False)
    with pytest.raises(TypeError, match=r"calibration batches\['a'\]\[0\] is a list, not a tokenised batch"):
        calibrate(merged, base, experts, {"a": [["some text", "more text"]], "b": batches["b"]}, progress=False)
    pad = merged.config.pad_token_id
    unmasked = {t: [{"input_ids": torch.where(b["attention_mask"].bool(), b["input_ids"], pad)} for b in bs]
                for t, bs in batches.items()}
    for t in unmasked:
        unmasked[t][0]["input_ids"][0, -2:] = pad    # padding the mask would have hidden
    with caplog.at_level("WARNING"):
        calibrate(merged, base, experts, unmasked, progress=False)
    assert "calibration batches['a'][0] holds padding (token id 0) but no attention_mask" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        calibrate(merged, base, experts, batches, progress=False)   # masked batches: no warning
    assert "holds padding" not in caplog.text


def test_tune_stage_refuses_a_password_in_tune_storage_before_loading_anything(tiny, tmp_path):
    params = copy.deepcopy(tiny.params)                       # no models/, experts/ here: nothing is loaded
    params["tune"]["storage"] = "postgresql://me:s3cret@db.example/featcal"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    done = tune_stage("--params", "params.yaml", cwd=tmp_path)
    err = done.stderr
    assert done.returncode != 0 and "tune.storage" in err and "~/.pgpass" in err and "s3cret" not in err
    assert list(tmp_path.iterdir()) == [tmp_path / "params.yaml"]


def test_claim_lock_lives_next_to_the_study_not_in_tmp(tmp_path):
    lock = tune.ClaimLock(f"sqlite:///{tmp_path / 'tune/study.db'}", "featcal-dev")
    assert lock.path.parent == (tmp_path / "tune").resolve() and lock.path.name.startswith(".study.db.claim-")


def test_run_trials_refuses_a_total_below_one(tmp_path):
    study = optuna.create_study()
    with pytest.raises(ValueError, match="n_trials must be >= 1, got 0"):
        tune.run_trials(study, lambda t: 0.0, 0)


# --- the real pipeline: nothing wrong is recorded in dvc.lock ------------------------------------------------


TARGET = "calibrate-layer@L01"   # the stages up to it are all these cases need (the rest would only cost time)


@pytest.fixture(scope="module")
def project(tiny_project, tmp_path_factory):
    """A copy of the session's reproduced tiny project (every stage up to TARGET recorded)."""
    project = copy_project(tiny_project.full, tmp_path_factory.mktemp("bad_inputs_dvc") / "project")
    # DVC's state (file hashes by inode and mtime) is per repository: record the copy's files now, so
    # that a later edit keeping size and mtime is as invisible to DVC as in a project that ran here
    restore(project)
    return project


def dvc(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([*DVC, *args], cwd=project, env=env, capture_output=True, text=True)


def restore(project: Path) -> None:
    """Back to the recorded state: the committed params, the outputs dvc.lock records."""
    run(["git", "checkout", "--", "params.yaml"], project)
    run([*DVC, "checkout", "-q", "--with-deps", TARGET], project)


@pytest.mark.slow
def test_dvc_repro_with_a_typo_fails_before_recording_anything(project):
    lock = (project / "dvc.lock").read_text()
    merged = (project / "models/merged/model.safetensors").read_bytes()
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["merge"]["optoins"] = params["merge"].pop("options")
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        out = dvc(project, "repro", TARGET)
    finally:
        restore(project)
    assert out.returncode != 0 and "merge.optoins" in out.stderr and "did you mean 'options'" in out.stderr, out.stderr
    assert (project / "dvc.lock").read_text() == lock
    written = project / "models/merged/model.safetensors"    # DVC removed the old output; nothing new came
    assert not written.exists() or written.read_bytes() == merged


@pytest.mark.slow
def test_dvc_exp_run_set_non_number_alpha_fails_naming_the_key(project):
    lock = (project / "dvc.lock").read_text()
    try:
        out = dvc(project, "exp", "run", "-S", "featcal.alpha=abc", TARGET)
    finally:
        restore(project)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "featcal.alpha = 'abc'" in text and "a finite number in [0, 1]" in text, text
    assert (project / "dvc.lock").read_text() == lock


def workspace_digest(project: Path) -> dict[str, str]:
    """Every file of the project outside .git and DVC's own folder, by content hash."""
    import hashlib

    return {str(p.relative_to(project)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(project.rglob("*"))
            if p.is_file() and not p.is_symlink() and not {".git", ".dvc"} & set(p.relative_to(project).parts)}


@pytest.mark.slow
@pytest.mark.parametrize("setting, says", [
    # a new task without regenerating stages/chain.yaml: `dvc exp run` removed data/tasks before refusing
    ("+tasks.extra={source: 'file:nowhere.csv'}", "stages/chain.yaml"),
    ("tune.storage=postgresql://u:secret@host/db", "the URL holds a password"),   # no stage reads it: never checked
    ("featcal.alpha=abc", "featcal.alpha = 'abc'"),
])
def test_a_refused_make_exp_leaves_the_workspace_as_it_was(project, setting, says):
    """`make exp SET=...` (stages/exp.py) checks the params with the setting applied before DVC runs."""
    before = workspace_digest(project)
    done = subprocess.run([sys.executable, "stages/exp.py", "--dvc", str(Path(sys.executable).parent / "dvc")], cwd=project,
                          env=dict(os.environ, SET=setting), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "exp: refused, nothing changed" in done.stderr and says in done.stderr, done.stderr
    assert "secret" not in done.stderr
    assert workspace_digest(project) == before
    assert "Running stage" not in done.stdout + done.stderr


@pytest.mark.slow
def test_dvc_repro_after_a_new_task_without_gen_chain_fails_before_any_stage_runs(project):
    lock = (project / "dvc.lock").read_text()
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["tasks"]["extra"] = dict(params["tasks"]["topic"])
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        out = dvc(project, "repro", TARGET)
    finally:
        restore(project)
    assert out.returncode != 0 and "run `python stages/gen_chain.py`" in out.stderr and "'extra'" in out.stderr
    assert "huggingface.co" not in out.stderr
    assert (project / "dvc.lock").read_text() == lock and not (project / "data/tasks/extra").exists()


@pytest.mark.slow
def test_flipped_bytes_in_a_cached_shard_fail_the_next_stage_naming_store_and_array(project):
    """Bit rot: same size, same mtime, so DVC sees nothing; the chunk checksum does."""
    store = project / "features/experts/layer_00.zarr"   # the first stage to read it is the first to run
    shard = max((p for p in store.rglob("*") if p.is_file() and p.name != "zarr.json"), key=lambda p: p.stat().st_size)
    array = shard.relative_to(store).parts[0]
    original, stat = shard.read_bytes(), shard.stat()
    data = bytearray(original)
    for i in range(len(data) // 4, len(data) // 4 + 16):     # inside the first chunks, away from the shard index
        data[i] ^= 0xFF
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    try:
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert "up to date" in dvc(project, "status", "collect-expert-features").stdout.lower()   # DVC is blind to it
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["featcal"]["alpha"] = 0.5
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        out = dvc(project, "repro", TARGET)
    finally:
        restore(project)
        shard.write_bytes(original)
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    failed = re.search(r"failed to reproduce '([^']+)'", out.stderr)
    assert out.returncode != 0 and failed, out.stderr
    assert failed.group(1) == "calibrate-layer@L00", out.stderr
    assert str(Path("features/experts/layer_00.zarr")) in out.stderr and f"array {array!r}" in out.stderr, out.stderr
    after = yaml.safe_load((project / "dvc.lock").read_text())
    assert after["stages"][failed.group(1)] == lock["stages"][failed.group(1)]   # not recorded with the damaged input
    assert after["stages"][TARGET] == lock["stages"][TARGET]
