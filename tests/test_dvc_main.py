"""stages/dvc_main.py: dvc.lock rewritten one stage at a time is the file DVC's own round trip writes."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import with_warm_stages
from dvc.utils.serialize._yaml import _dump, parse_yaml_for_update

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
import dvc_main  # noqa: E402

sys.path.pop(0)


def stage(name: str, md5: str, cmd_words: int = 30) -> dict:
    """Lock data shaped like DVC's: a long command (wrapped by the emitter), deps, params with a null
    and a float-looking string, outs."""
    cmd = "python stages/x.py " + " ".join(f"--opt{i} results/some/long/path_{i}.json" for i in range(cmd_words))
    return {name: {"cmd": cmd, "deps": [{"path": "stages/x.py", "hash": "md5", "md5": md5, "size": 1234}],
                   "params": {"params.yaml": {"featcal": {"alpha": 0.25, "ridge": 1e-05, "layers": None,
                                                          "name": "1e10", "flag": "on"}}},
                   "outs": [{"path": f"out/{name}", "hash": "md5", "md5": md5 + ".dir", "size": 9, "nfiles": 2}]}}


def dvc_round_trip(text: str, update: dict) -> str:
    """What DVC 3's Lockfile.dump_stages writes: the whole lock parsed round-trip, updated, emitted."""
    data = parse_yaml_for_update(text, "dvc.lock")
    data["stages"].update(update)
    out = io.StringIO()
    _dump(data, out)
    return out.getvalue()


def lock_text(*stages: dict) -> str:
    out = io.StringIO()
    _dump({"schema": "2.0", "stages": {k: v for s in stages for k, v in s.items()}}, out)
    return out.getvalue()


def test_a_spliced_entry_is_the_bytes_dvcs_round_trip_writes():
    text = lock_text(stage("merge", "0123e45"), stage("calibrate-layer@L00", "ab" * 16), stage("evaluate", "cd" * 16))
    for update in (stage("calibrate-layer@L00", "99" * 16, cmd_words=3),   # an entry changes (and shrinks)
                   stage("merge", "0123e45", cmd_words=31),
                   stage("tune", "ef" * 16)):                               # a new stage goes last
        new, changed = dvc_main.spliced(text, [update])
        assert changed and new == dvc_round_trip(text, update)
    same, changed = dvc_main.spliced(text, [stage("evaluate", "cd" * 16)])
    assert same == text and not changed
    assert yaml.safe_load(dvc_main.spliced(text, [stage("merge", "77" * 16)])[0])["stages"]["merge"]["deps"][0]["md5"] \
        == "77" * 16


@pytest.mark.parametrize("odd", ["# a comment\n", "\n", "datasets: []\n"])
def test_a_lock_not_in_dvcs_own_form_is_left_to_dvc(odd):
    """Comments, blank lines or a top-level key after the stages: DVC's own code writes it."""
    text = lock_text(stage("merge", "ab" * 16))
    assert dvc_main.spliced(text + odd, [stage("merge", "cd" * 16)]) is None
    if not odd.startswith("datasets"):   # a key before `stages:` is part of the kept header
        assert dvc_main.spliced(odd + text, [stage("merge", "cd" * 16)]) is None
    assert dvc_main.split_lock("schema: '2.0'\n") is None


@pytest.mark.filterwarnings("ignore:_NoneStep.value:DeprecationWarning")   # DVC's own, in process here
def test_dvc_with_the_spliced_lock_writes_what_dvc_writes(tmp_path, monkeypatch):
    """The same `dvc repro` runs (a first one, then one after a params change) in two copies of a
    project, one with DVC's own lock writes and one with `install`'s: the same dvc.lock each time."""
    from dvc.dvcfile import Lockfile
    from dvc.repo import Repo

    source = tmp_path / "source"
    source.mkdir()
    long_tail = " ".join(f"--option-{i} some/long/path/{i}" for i in range(12))
    stages = {f"step{i}": {"cmd": f"echo {i} > out{i}.txt # {long_tail}", "params": ["alpha", "nested.beta"],
                           "deps": [f"out{i - 1}.txt"] if i else [], "outs": [f"out{i}.txt"]} for i in range(3)}
    (source / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (source / "params.yaml").write_text("alpha: 0.25\nnested: {beta: null}\n")
    Repo.init(str(source), no_scm=True)
    original = Lockfile.dump_stages
    monkeypatch.setattr(Lockfile, "dump_stages", original)   # DVC's own again after the test
    locks = {}
    for variant in ("dvc", "spliced"):
        project = shutil.copytree(source, tmp_path / variant)
        monkeypatch.chdir(project)
        if variant == "spliced":
            dvc_main.install()
            assert Lockfile.dump_stages is not original
        for alpha in ("0.25", "0.5"):
            (project / "params.yaml").write_text(f"alpha: {alpha}\nnested: {{beta: null}}\n")
            with Repo(str(project)) as repo:
                repo.reproduce()
            locks[variant, alpha] = (project / "dvc.lock").read_text()
    assert locks["dvc", "0.5"] != locks["dvc", "0.25"]
    assert locks["spliced", "0.25"] == locks["dvc", "0.25"] and locks["spliced", "0.5"] == locks["dvc", "0.5"]


def test_make_repro_and_make_exp_run_the_dvc_executable_as_dvc_main(tmp_path):
    """stages/with_warm_stages.py turns `<venv>/bin/dvc ARGS` into `<its python> stages/dvc_main.py
    ARGS`; another command, or a `dvc` that is a shell wrapper, runs as given."""
    dvc = Path(sys.executable).with_name("dvc")
    interpreter = dvc.read_text().splitlines()[0][2:].strip()
    assert with_warm_stages.with_dvc_main([str(dvc), "repro", "-q"]) == \
        [interpreter, str(with_warm_stages.DVC_MAIN), "repro", "-q"]
    assert with_warm_stages.DVC_MAIN == Path(dvc_main.__file__).resolve()
    wrapper = tmp_path / "bin" / "dvc"
    wrapper.parent.mkdir()
    wrapper.write_text("#!/bin/sh\nexec true\n")
    wrapper.chmod(0o755)
    assert with_warm_stages.with_dvc_main([str(wrapper), "repro"]) == [str(wrapper), "repro"]
    assert with_warm_stages.with_dvc_main([sys.executable, "stages/exp.py"]) == [sys.executable, "stages/exp.py"]
