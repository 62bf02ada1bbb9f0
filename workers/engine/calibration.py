"""The cost model's seed: a few timed steps of dummy sequences when the engine starts."""
import time

from tidepool.workers.engine.cost_model import CostModel, attended
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.scheduler import ScheduledBatch
from tidepool.workers.engine.sequence import Sequence


def _best_of_3(runner, batch) -> float:
    best = float("inf")
    for _ in range(3):                              # the fastest of three: less noise from other processes
        t0 = time.perf_counter()
        runner.run(batch)
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(cost: CostModel, runner, num_blocks: int, block_size: int, max_num_seqs: int,
              max_num_batched_tokens: int, max_model_len: int) -> None:
    """Seed `cost` from a few timed steps of dummy sequences on the (still empty) KV pool: a prompt chunk,
    a batch of decodes and a single decode; with LoRA slots (runner.lora), the decode batch again spread over
    the slots (zero-filled: they cost what loaded adapters do), for the per-adapter term. Writes only blocks that
    no sequence owns yet."""
    pool = num_blocks * block_size

    def batch_of(shapes):                  # [(context already computed, new tokens)]
        batch, next_block = ScheduledBatch(), 0
        for start, n in shapes:
            seq = Sequence("calibration", [1] * (start + n), SamplingParams())
            blocks = -(-(start + n) // block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            seq.num_computed_tokens = start
            next_block += blocks
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.attended += attended(start, n)
        return batch if next_block <= num_blocks else None

    longest = min(pool, max_model_len)
    prompt = max(1, min(64, max_num_batched_tokens, longest - 1))
    width = max(1, min(16, max_num_seqs, max_num_batched_tokens))
    context = max(1, min(64, pool // width - block_size, longest - 1))
    shapes = [[(0, prompt)], [(context, 1)] * width, [(min(16, longest - 1), 1)]]
    runner.run(batch_of([(0, min(16, longest))]))       # warm-up: first calls allocate and build
    decode_s = None
    for shape in shapes:
        batch = batch_of(shape)
        if batch is None:
            continue
        best = _best_of_3(runner, batch)
        cost.observe(batch.num_tokens, batch.attended, best)
        if shape is shapes[1]:
            decode_s = best
    per_adapter = None
    lora = getattr(runner, "lora", None)
    batch = batch_of(shapes[1])
    if lora is not None and batch is not None and decode_s is not None:
        k = min(lora.max_loras, len(batch.seqs))
        lora.calibration_slots = [i % k for i in range(batch.num_tokens)]
        try:
            runner.run(batch)                           # warm-up of the adapter path
            per_adapter = max(0.0, _best_of_3(runner, batch) - decode_s) / k
        finally:
            lora.calibration_slots = None
    cost.seed(cost.fixed, cost.per_token, cost.per_context, per_adapter)
