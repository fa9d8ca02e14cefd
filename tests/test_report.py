"""The result plots the stages draw, and `make report`'s static page, opened in a real browser.

The browser test drives Debian's chromium (installed by tests/system_deps.sh) with Playwright for
Python; Playwright never downloads a browser of its own. It builds the page from the repository's
committed results and saves a screenshot of it to results/plots/report.png (shown by README.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from featcal.evaluation import plots
from featcal.evaluation.report import find_plots, render, write_report
from featcal.tuning.comparison import as_mapping, comparison_rows
from tiny_project import ROOT

sys.path.insert(0, str(ROOT / "stages"))
import report as stages_report  # noqa: E402  (stages/report.py, what `make report` runs)

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
PNG = b"\x89PNG\r\n\x1a\n"
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = ROOT / "results/plots/report.png"


def scores(avg: float, gap: float | None = None) -> dict:
    return {"avg": avg, "gap_closed": gap, "sentiment": avg + 0.05, "topic": avg - 0.05}


def tiny_compare() -> dict:
    """results/compare_defaults.json's shape, two anchors (the second without ProbSurgery)."""
    def anchor(merged: float, **methods: float) -> dict:
        return {"merge_cost": {"wall_s": 1.5}, "merged": scores(merged, 0.0),
                **{m: {"scores": scores(v, 0.5), "cost": {"wall_s": 2.0}} for m, v in methods.items()}}
    return {"experts": scores(0.8), "examples_per_task": 4,
            "anchors": {"average": anchor(0.55, surgery=0.7, probsurgery=0.68, featcal=0.72),
                        "task_arithmetic": anchor(0.6, surgery=0.71, featcal=0.7)}}


def tiny_metrics() -> dict:
    return {"experts": scores(0.8), "merged": scores(0.6), "featcal": scores(0.7), "gap_closed": 0.5}


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG, path


# --- the plots -------------------------------------------------------------------------------------


def test_compare_plot_is_a_png_from_the_comparison(tmp_path):
    plots.plot_compare(tiny_compare(), tmp_path / "compare.png")
    assert_png(tmp_path / "compare.png")
    committed = ROOT / "results/compare_defaults.json"
    if committed.exists():   # the full eleven-anchor comparison draws as well
        plots.plot_compare(json.loads(committed.read_text()), tmp_path / "full.png")
        assert_png(tmp_path / "full.png")


def test_corruption_plot_is_a_png_from_the_committed_corruption_results(tmp_path):
    corruption = json.loads((ROOT / "results/corruption.json").read_text())
    plots.plot_corruption(corruption, tmp_path / "plots/corruption.png")
    assert_png(tmp_path / "plots/corruption.png")
    assert not list((tmp_path / "plots").glob(".*"))          # the atomic writer left no temporary file


@pytest.mark.parametrize("n_trials", [0, 1, 5])
def test_tuning_plots_draw_what_the_trials_allow(tmp_path, n_trials):
    """History and importances from an Optuna study; with fewer than 2 complete trials the importances
    plot says so instead of failing (get_param_importances needs two)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: t.suggest_float("alpha", 0, 1) - (t.suggest_float("rho", 1, 3) - 2) ** 2
                   + 0 * t.suggest_float("ridge", 1e-3, 1e-1, log=True), n_trials=n_trials)
    plots.plot_study(study, tmp_path / "history.png", tmp_path / "importance.png")
    assert_png(tmp_path / "history.png")
    assert_png(tmp_path / "importance.png")


# --- the page --------------------------------------------------------------------------------------


def test_the_page_holds_everything_it_shows(tmp_path):
    (tmp_path / "plots/sigmerge").mkdir(parents=True)
    plots.plot_compare(tiny_compare(), tmp_path / "plots/compare.png")
    shutil.copy(tmp_path / "plots/compare.png", tmp_path / "plots/sigmerge/ties.png")
    (tmp_path / "plots/report.png").write_bytes(PNG)              # the page's own screenshot: never embedded
    found = find_plots(tmp_path / "plots")
    assert [p.relative_to(tmp_path / "plots").as_posix() for p, _ in found] == ["compare.png", "sigmerge/ties.png"]
    assert "anchor ties" in found[1][1]
    page = render(tiny_metrics(), found, tiny_compare())
    assert page.count('<img src="data:image/png;base64,') == 2 and len(re.findall(r"<img\b", page)) == 2
    outside_images = re.sub(r'"data:[^"]*"', '""', page)
    assert not re.search(r"https?:|//|\bsrc=\"(?!\")|\burl\(", outside_images), "the page names an address"
    assert "<script" not in page and "+ ProbSurgery" in page and "task_arithmetic" in page
    assert "Gap closed: <b>0.50</b>" in page
    no_compare = render(tiny_metrics(), [], None)
    assert "compare_defaults.json" not in no_compare and "<img" not in no_compare


def test_the_dev_tuned_comparison_is_a_table_of_the_page_with_dev_picks_in_bold(tmp_path):
    """results/compare.json (stages/compare_tuned.py's shape) read back as rows and text cells."""
    study = {"study": "s", "best": {"dev_avg": 0.76, "params": {"rank": 4}}, "trials": {"complete": 3},
             "trial_wall_s": {"mean": 2.0}, "test": {"avg": 0.71, "sentiment": 0.7, "topic": 0.72}}
    featcal = {**study, "best": {"dev_avg": 0.75, "params": {"alpha": 0.3}}, "test": {**study["test"], "avg": 0.7249}}
    rows = comparison_rows(0.8, {"ties": {"avg": 0.6, "sentiment": 0.6, "topic": 0.6}},
                           {("ties", "featcal"): featcal, ("ties", "surgery"): study}, width=4, n_tasks=2)
    (tmp_path / "compare.json").write_text(json.dumps({
        "tasks": ["sentiment", "topic"], "anchors": as_mapping(rows),
        "dev_best": {"anchor": "ties", "method": "surgery"}, "dev_best_featcal": {"anchor": "ties", "method": "featcal"}}))
    table = stages_report.tuned_table(tmp_path / "compare.json")
    assert [line[:2] for line in table.rows] == [["ties", "alone"], ["ties", "featcal"], ["ties", "surgery"]]
    assert table.bold == frozenset({1, 2}) and table.rows[1][4] == "72.5" and table.rows[2][-1] == "64"
    page = render(tiny_metrics(), [], None, tuned=table)
    assert "<code>results/compare.json</code>" in page
    assert '<tr class="head"><td class="name">ties</td><td class="name">surgery</td>' in page
    assert stages_report.tuned_table(tmp_path / "missing.json") is None
    (tmp_path / "old.json").write_text(json.dumps({"anchors": {"ties": {"featcal": {"avg": 0.7}}}}))
    with pytest.raises(SystemExit, match=r"old.json is not stages/compare_tuned.py's comparison .*compare_tuned.py"):
        stages_report.tuned_table(tmp_path / "old.json")
    assert "compare.json" not in render(tiny_metrics(), [], None)


def test_make_report_writes_the_page_without_an_active_virtualenv(tmp_path):
    """`make report` in a copy of the project's Makefile, pins and results, with no virtualenv on PATH."""
    project = tmp_path / "project"
    (project / "results").mkdir(parents=True)
    for name in ("Makefile", "requirements.txt", "requirements.lock", "pyproject.toml"):
        shutil.copy2(ROOT / name, project / name)          # older than the venv's install stamp: no re-install
    shutil.copytree(ROOT / "stages", project / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("metrics.json", "compare.json"):
        shutil.copy2(ROOT / "results" / name, project / "results" / name)
    (project / "results/plots").mkdir()
    shutil.copy2(ROOT / "results/plots/drift.png", project / "results/plots/drift.png")
    (project / ".venv").symlink_to(ROOT / ".venv")
    # two runs' DVCLive logs (steps and values as finetune@<task> writes them): drawn as one figure
    for task, rows in (("a", [(1, 0.5, 0.9), (2, 0.7, 0.6)]), ("b", [(1, 0.6, 1.1)])):
        logs = project / "results/live/finetune" / task / "plots/metrics"
        logs.mkdir(parents=True)
        (logs / "dev_accuracy.tsv").write_text("step\tdev_accuracy\n" + "".join(f"{s}\t{d}\n" for s, d, _ in rows))
        (logs / "train_loss.tsv").write_text("step\ttrain_loss\n" + "".join(f"{s}\t{l}\n" for s, _, l in rows))
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin and ".venv" not in p)
    done = subprocess.run(["make", "report"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    page = (project / "results/report.html").read_text()
    assert page.count("<img ") == 2 and "compare_defaults.json" not in page   # no comparison yet: its table is left out
    assert "Fine-tuning, per task: train loss and dev accuracy per epoch" in page
    compared = json.loads((ROOT / "results/compare.json").read_text())   # the dev-tuned table, dev's pick in bold
    best = compared.get("selected", {}).get("overall") or compared["dev_best"]
    assert f'<tr class="head"><td class="name">{best["anchor"]}</td><td class="name">{best["method"]}</td>' in page
    curves = stages_report.read_live(project / "results/live/finetune")
    assert curves == {"a": {"dev_accuracy": [(1, 0.5), (2, 0.7)], "train_loss": [(1, 0.9), (2, 0.6)]},
                      "b": {"dev_accuracy": [(1, 0.6)], "train_loss": [(1, 1.1)]}}
    missing = subprocess.run([sys.executable, "stages/report.py", "--metrics", "nope.json", "--plots", "results/plots",
                              "--out", "x.html"], cwd=project, capture_output=True, text=True)
    assert missing.returncode != 0 and "report: error: no metrics at nope.json" in missing.stderr


def test_the_page_renders_offline_in_chromium(tmp_path):
    """The page built from the committed results, in headless Debian chromium with the network off:
    every image decodes, nothing is logged as an error, nothing but the page itself is requested."""
    from playwright.sync_api import sync_playwright   # the PyPI package; no browser of its own

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: run `bash tests/system_deps.sh` as root (Debian chromium)"
    compare = ROOT / "results/compare_defaults.json"
    page_path = write_report(tmp_path / "report.html", ROOT / "results/metrics.json", ROOT / "results/plots",
                             compare if compare.exists() else None,
                             tuned=stages_report.tuned_table(ROOT / "results/compare.json"))
    expected_images = len(find_plots(ROOT / "results/plots"))
    assert expected_images >= 1
    requests, errors = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = browser.new_context(offline=True, viewport={"width": 1200, "height": 1000})
            page = context.new_page()
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri(), wait_until="load")
            page.wait_for_function(
                "() => document.images.length > 0 && Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)",
                timeout=30_000)
            images = page.evaluate("() => Array.from(document.images).map(i => [i.naturalWidth, i.alt])")
            headline = page.inner_text("table")
            tables = page.evaluate("() => Array.from(document.querySelectorAll('table')).map(t => t.innerText)")
            tmp_shot = SCREENSHOT.with_name(f".{SCREENSHOT.name}.tmp.png")
            page.screenshot(path=str(tmp_shot))
            os.replace(tmp_shot, SCREENSHOT)
        finally:
            browser.close()
    assert len(images) == expected_images and all(w > 0 for w, _ in images), images
    assert "+ FeatCal" in headline and "experts" in headline, headline
    # the dev-tuned comparison as the reader sees it: every row's interval, the differences to its
    # anchor's best row that the test split cannot resolve marked n.s.
    tuned = next(t for t in tables if "vs anchor's best (95 % CI)" in t)
    compared = json.loads((ROOT / "results/compare.json").read_text())
    first = next(iter(compared["anchors"].values()))
    low, high = next(iter(first.values()))["ci95"]["avg"]
    assert f"[{100 * low:.1f}, {100 * high:.1f}]" in tuned, tuned
    not_significant = sum(not s for marks in compared["significant_vs_best"].values() for s in marks["rows"].values())
    assert tuned.count("n.s.") == not_significant > 0
    assert not errors, errors
    assert requests and all(u == page_path.as_uri() or u.startswith("data:") for u in requests), requests
    assert_png(SCREENSHOT)
