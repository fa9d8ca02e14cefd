"""Fine-tuning's per-epoch log: what it reports, and that logging leaves the weights alone."""

import torch
from transformers import BertForSequenceClassification, BertTokenizer

from conftest import assert_same_state
from featcal.data.encoders import TextEncoder
from featcal.data.splits import TaskSplit
from featcal.finetune import FinetuneConfig, accuracy, finetune
from tiny_project import WORDS, make_base


def split(name: str, n: int, seed: int) -> TaskSplit:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (n, 4), generator=g).flatten().tolist()]
    texts = [" ".join(words[4 * i:4 * i + 4]) + (" good" if y else " bad") for i, y in enumerate(labels.tolist())]
    return TaskSplit("toy", name, texts, labels)


def model_and_tokenizer(path):
    make_base(path, layers=1)
    return BertForSequenceClassification.from_pretrained(path, num_labels=2), TextEncoder(BertTokenizer.from_pretrained(path))


def test_each_epoch_reports_its_mean_loss_and_dev_accuracy_and_the_weights_are_those_without_logging(tmp_path):
    train, dev = split("train", 40, 0), split("dev", 12, 1)
    # 2.5 epochs of 3 steps (batch 16 over 40): the log has epochs 1, 2 and the partial third
    config = FinetuneConfig(learning_rate=1e-3, epochs=2.5, batch_size=16, max_length=16, seed=0)
    model, tokenizer = model_and_tokenizer(tmp_path / "base")
    plain = finetune(model, tokenizer, train, config, progress=False)

    logged, seen = [], []
    model, tokenizer = model_and_tokenizer(tmp_path / "base")
    original_forward = model.forward

    def counting_forward(*args, **kwargs):
        out = original_forward(*args, **kwargs)
        if model.training:
            seen.append(out.loss.item())
        return out

    model.forward = counting_forward
    trained = finetune(model, tokenizer, train, config, progress=False, dev=dev,
                       on_epoch=lambda epoch, metrics: logged.append((epoch, metrics)))
    assert_same_state(trained, plain)
    assert [epoch for epoch, _ in logged] == [1, 2, 3]
    assert [len(m) for _, m in logged] == [2, 2, 2]
    per_epoch = [seen[0:3], seen[3:6], seen[6:8]]          # 8 steps: round(2.5 x 3)
    for (_, metrics), losses in zip(logged, per_epoch):
        assert abs(metrics["train_loss"] - sum(losses) / len(losses)) < 1e-12
    assert logged[-1][1]["dev_accuracy"] == accuracy(trained, tokenizer, dev, config.max_length)
    assert not trained.training


def test_without_dev_the_log_has_the_loss_only(tmp_path):
    model, tokenizer = model_and_tokenizer(tmp_path / "base")
    logged = []
    finetune(model, tokenizer, split("train", 20, 0), FinetuneConfig(epochs=1, batch_size=8, max_length=16),
             progress=False, on_epoch=lambda epoch, metrics: logged.append((epoch, set(metrics))))
    assert logged == [(1, {"train_loss"})]


def test_into_a_file_the_progress_bar_writes_a_few_lines_not_one_per_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_MININTERVAL", "30")     # what the Makefile sets when stderr is not a terminal
    monkeypatch.setenv("TQDM_MAXINTERVAL", "30")     # (else a slow step on a loaded machine is redrawn every 10 s)
    model, tokenizer = model_and_tokenizer(tmp_path / "base")
    finetune(model, tokenizer, split("train", 64, 0), FinetuneConfig(epochs=1, batch_size=8, max_length=16))
    writes = capsys.readouterr().err.count("finetune toy")
    assert 1 <= writes <= 2, writes                   # the opening and the closing state, not 8 steps
