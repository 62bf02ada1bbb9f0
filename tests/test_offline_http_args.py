"""benchmarks/offline_http.py's arguments, workload and ratios (no path runs here: nothing is started)."""
import importlib.util
import sys
from pathlib import Path

import pytest

_bench = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_bench))
try:
    _spec = importlib.util.spec_from_file_location("offline_http_bench", _bench / "offline_http.py")
    bench = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bench)
finally:
    sys.path.remove(str(_bench))


def test_defaults_are_the_issue_workload_on_four_paths():
    args = bench.parse_args([])
    assert (args.requests, args.tokens, args.max_num_seqs) == (128, 128, 64)
    assert args.model.endswith("models/smollm2-135m")
    assert args.paths == ["engine", "run_batch", "serve", "production"]
    assert bench.parse_args(["--peer", "http://127.0.0.1:8100"]).paths[-1] == "peer"


def test_only_picks_paths_in_order_and_the_peer_needs_a_url():
    assert bench.parse_args(["--only", "d, a"]).paths == ["engine", "production"]
    assert bench.parse_args(["--only", "e", "--peer", "http://x:1"]).paths == ["peer"]
    for bad in (["--only", "e"], ["--only", "a,z"], ["--only", ","], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_workload_is_seeded_and_in_range():
    prompts = bench.workload(128, 500, seed=3)
    assert prompts == bench.workload(128, 500, seed=3) != bench.workload(128, 500, seed=4)
    assert len(prompts) == 128
    assert all(16 <= len(p) <= 512 for p in prompts)
    assert all(100 <= t < 500 for p in prompts for t in p)
    assert len({len(p) for p in prompts}) > 32          # lengths spread over the range


def test_ratios_and_goals():
    paths = {"engine": bench.figures(1000, 5.0), "serve": bench.figures(1000, 10.0),
             "production": bench.figures(1000, 5.1), "peer": bench.figures(1000, 5.0)}
    assert paths["engine"]["gen_tok_s"] == 200.0
    line = {"over_engine": bench.ratios(paths, "engine"), "over_peer": bench.ratios(paths, "peer")}
    assert line["over_engine"] == {"serve": 0.5, "production": 0.98, "peer": 1.0}
    assert bench.ratios({"serve": paths["serve"]}, "engine") == {}
    assert bench.goals(line) == {"serve >= 0.95x the engine": False, "serve >= 1.0x the peer": False,
                                 "production >= 0.95x the engine": True, "production >= 1.0x the peer": False}
    with pytest.raises(RuntimeError):
        bench._checked("serve", [128] * 127 + [127], bench.parse_args([]))
