"""Decode-step time with CUDA graphs against eager launches of the same model runner (GPU only).

For each batch size, B sequences of --context tokens sit in the KV cache and one decode step (model forward
plus logits) is timed both ways on the same runner, weights and cache; the ratio is eager / graphs.

    python benchmarks/decode_graphs.py [--model models/smollm2-135m] [--batches 1,8,32,128,256] [--context 512]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tidepool.workers.engine import LLMEngine, SamplingParams  # noqa: E402
from tidepool.workers.engine.config import EngineConfig  # noqa: E402
from tidepool.workers.engine.scheduler import ScheduledBatch  # noqa: E402
from tidepool.workers.engine.sequence import Sequence  # noqa: E402
from results import record  # noqa: E402


def decode_batch(engine: LLMEngine, batch_size: int, context: int) -> ScheduledBatch:
    batch = ScheduledBatch()
    vocab = engine.config.model_config.vocab_size
    for i in range(batch_size):
        seq = Sequence(f"b{batch_size}-{i}", [(i * 7919 + t) % (vocab - 100) + 100 for t in range(context)],
                       SamplingParams(max_tokens=1))
        if not engine.block_manager.allocate(seq, seq.num_tokens):
            raise SystemExit(f"KV pool too small for {batch_size} x {context} tokens")
        seq.num_computed_tokens = context - 1
        batch.seqs.append(seq)
        batch.num_new_tokens.append(1)
    return batch


def time_step(runner, batch, iters: int) -> float:
    for _ in range(3):
        runner.run(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        runner.run(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main():
    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 128, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("CUDA graphs need a GPU; this machine has none")
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", dtype=args.dtype,
                                    max_num_seqs=max(args.batches)))
    runner, graphs = engine.runner, engine.runner.decode_graphs
    print(f"model {args.model} | {torch.cuda.get_device_name()} | dtype {runner.dtype} | context {args.context}"
          f" | graphs for {graphs.sizes}")
    print(f"{'batch':>6} {'eager ms':>10} {'graphs ms':>10} {'speedup':>8}")
    rows = []
    for batch_size in args.batches:
        batch = decode_batch(engine, batch_size, args.context)
        runner.decode_graphs = None
        eager_ms = time_step(runner, batch, args.iters)
        runner.decode_graphs = graphs
        replays = graphs.replays
        graph_ms = time_step(runner, batch, args.iters)
        assert graphs.replays > replays, "the graph path did not run"
        print(f"{batch_size:>6} {eager_ms:>10.3f} {graph_ms:>10.3f} {eager_ms / graph_ms:>7.2f}x")
        rows.append({"batch": batch_size, "eager_ms": eager_ms, "graphs_ms": graph_ms})
        for seq in batch.seqs:
            engine.block_manager.free_sequence(seq)
    record("decode_graphs", {"model": Path(args.model).name, "gpu": torch.cuda.get_device_name(),
                             "dtype": str(runner.dtype).split(".")[-1], "context": args.context, "rows": rows})


if __name__ == "__main__":
    main()
