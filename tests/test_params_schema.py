"""stages/params_schema.py: the pydantic schema of params.yaml keeps its strict types and its words,
and the JSON Schema editors read (stages/params.schema.json) is what the schema prints."""

import copy
import subprocess
import sys

import pytest
import yaml

from tiny_project import ROOT

sys.path.insert(0, str(ROOT / "stages"))
from params_schema import ParamsError, Tune, validate, validate_tuned  # noqa: E402

SCHEMA_FILE = ROOT / "stages/params.schema.json"


def test_the_committed_json_schema_is_what_the_schema_prints():
    printed = subprocess.run([sys.executable, "stages/params_schema.py", "--json-schema"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert SCHEMA_FILE.read_text(encoding="utf-8") == printed, (
        "stages/params.schema.json is stale: run `python stages/params_schema.py --json-schema > stages/params.schema.json`")


@pytest.mark.parametrize("key, value, says", [
    ("featcal.alpha", "0.3", "featcal.alpha = '0.3': expected a finite number in [0, 1]"),
    ("calibration.batch_size", True, "calibration.batch_size = True: expected an integer >= 1"),
    ("calibration.batch_size", 16.0, "calibration.batch_size = 16.0: expected an integer >= 1"),
    ("featcal.use_tuned", 1, "featcal.use_tuned = 1: expected true or false"),
    ("tune.study_name", " ", "tune.study_name = ' ': expected a non-empty string"),
    ("featcal.device", "gpu", "featcal.device = 'gpu': expected auto, cpu, cuda or cuda:N"),
    ("tune.search", {"rho": [2, 1]}, "tune.search.rho = {'low': 2, 'high': 1}: low must be below high"),
    ("compare.sigmerge.grid", [[0.3, 0.2]], "compare.sigmerge.grid[0] = [0.3, 0.2]: expected [c_min, c_max]"),
    ("tokens", 5, "tokens = 5: expected a mapping of keys"),
    ("featcal.calibrate_bais", True, "featcal.calibrate_bais: unknown key 'calibrate_bais' (did you mean 'calibrate_bias'?)"),
])
def test_strict_values_are_refused_in_todays_words(key, value, says):
    raw = copy.deepcopy(yaml.safe_load((ROOT / "params.yaml").read_text()))
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node[last] = value
    with pytest.raises(ParamsError) as err:
        validate(raw, ROOT, models=False)
    assert str(err.value).startswith(says), str(err.value)


def test_defaults_and_tuned_values():
    params = validate(yaml.safe_load((ROOT / "params.yaml").read_text()), ROOT, models=False)
    assert isinstance(params.featcal.alpha, float) and params.tune.search["ridge"].log
    assert (Tune().study_name, Tune().n_trials) == ("featcal-dev", 24)
    tuned = validate_tuned({"featcal": {"alpha": 0.1, "rho": 1, "ridge": 0.2, "layer_overrides": {0: {"alpha": 0.3}}}})
    assert tuned == {"alpha": 0.1, "rho": 1.0, "ridge": 0.2, "layer_overrides": {0: {"alpha": 0.3}}}
    with pytest.raises(ParamsError, match=r"^featcal\.rho: missing; it is required$"):
        validate_tuned({"featcal": {"alpha": 0.1, "bogus": 1}, "study": {}})
