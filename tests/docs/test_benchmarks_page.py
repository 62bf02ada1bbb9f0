"""The benchmarks page is rendered from benchmarks/results/ by benchmarks/report.py: every benchmark script records
its result with the machine, torch version, commit and date (benchmarks/results.py), every script has a place on the
page, a benchmark without a result says so, and the committed page is what the committed results render."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def report():
    return _load("report")


@pytest.fixture(scope="module")
def results():
    return _load("results")


def test_the_committed_page_is_what_the_results_render(report, results, tmp_path):
    page = report.render(results.load(results.RESULTS), tmp_path / "assets")
    assert (ROOT / "docs" / "benchmarks.md").read_text() == page, \
        "docs/benchmarks.md is stale: run `python benchmarks/report.py` and commit it with its plots"
    for image in re.findall(r"\]\((assets/benchmarks/[^)]+\.png)\)", page):
        assert (ROOT / "docs" / image).is_file(), f"docs/{image} missing: run `python benchmarks/report.py`"


def test_every_benchmark_script_records_its_result_and_has_a_place_on_the_page(report):
    scripts = {p.name for p in BENCH.glob("*.py")} - report.NOT_BENCHMARKS
    placed = {script for _, script, _, _ in report.benchmarks()}
    assert scripts - placed == set(), f"benchmarks without a place on the page (add them to report.SECTIONS): " \
                                      f"{sorted(scripts - placed)}"
    silent = sorted(s for s in scripts if "record(" not in (BENCH / s).read_text())
    assert not silent, f"benchmarks that do not record their result (call results.record): {silent}"
    for name, script, _, _ in report.benchmarks():
        text = (BENCH / script).read_text()
        assert f'record("{name}"' in text or 'record(f"' in text, (name, script)


def test_a_result_names_its_machine_and_date_and_a_missing_one_says_so(report, results, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEPOOL_BENCH_RESULTS", str(tmp_path / "results"))
    path = results.record("engine_throughput", {"engine": {"tok_s": 123.4}, "vs_static": 3.2},
                          argv=[str(BENCH / "engine_throughput.py"), "--num-requests", "8"])
    line = json.loads(path.read_text())
    assert line["command"] == "python benchmarks/engine_throughput.py --num-requests 8"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", line["date"])
    assert line["machine"]["cpu"] and line["machine"]["cpus"] >= 1 and line["torch"]
    assert line["commit"] and len(line["commit"]) == 12
    page = report.render(results.load(), tmp_path / "assets")
    measured = page.split("### Offline throughput against transformers")[1].split("### ")[0]
    assert f"on {line['machine']['cpu']}" in measured and line["date"] in measured and "123" in measured
    assert "python benchmarks/engine_throughput.py --num-requests 8" in measured
    assert report.NOT_MEASURED not in measured
    fairness = page.split("### Fair intake against FIFO")[1].split("### ")[0]
    assert report.NOT_MEASURED in fairness


def test_a_curve_becomes_a_plot(report, tmp_path):
    result = {"servers": [{"server": "tidepool", "rt_alone": {"ttft_ms": {"p99": 100.0}},
                           "series": {"alone_ttft": [[0.0, 90.0], [1.0, 95.0]],
                                      "mixed_ttft": [[0.0, 120.0], [0.7, 180.0]],
                                      "mixed_offline_done": [[0.5, 128], [1.0, 128]]}}]}
    lines = report.plot_hybrid_http(result, tmp_path)
    assert lines[0] == "![hybrid_http-tidepool](assets/benchmarks/hybrid_http-tidepool.png)"
    assert (tmp_path / "hybrid_http-tidepool.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
