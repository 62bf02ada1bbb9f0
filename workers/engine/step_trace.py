"""One JSON line per engine step (EngineConfig.step_trace, TIDEPOOL_STEP_TRACE): where a step's time went.

    {"t": 12.345, "idle_s": .., "schedule_s": .., "model_s": .., "sample_s": .., "predicted_s": ..,
     "limit_s": .., "online": [rows, new tokens, prompt tokens], "offline": [rows, new tokens, prompt tokens],
     "first_tokens": n}

t is the step's start on the monotonic clock; idle_s the time since the previous step ended (the engine
waiting for work, or its thread held off by another); limit_s the time bound the scheduler gave offline tokens
(null: none). A step that ran another between two of its layers (the step cut) has cut_s, the time that one took
(not in its model_s); that one's line, written first, has cut_in. Lines are buffered and flushed every FLUSH_EVERY
steps and at exit, so tracing costs microseconds a step.
"""
import atexit
import json

FLUSH_EVERY = 64


class StepTrace:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1 << 16)
        self._last_end: float | None = None
        self._steps = 0
        atexit.register(self.close)

    def count(self, batch) -> dict:
        """Before the step runs: rows, new tokens and prompt tokens, online and offline, and the first tokens it
        brings (an online prompt whose last chunk it computes)."""
        kinds = {True: [0, 0, 0], False: [0, 0, 0]}
        first = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            row = kinds[seq.is_online]
            prompt = min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
            row[0] += 1
            row[1] += n
            row[2] += prompt
            first += seq.is_online and prompt > 0 and seq.num_computed_tokens + n >= seq.num_prompt_tokens
        return {"online": kinds[True], "offline": kinds[False], "first_tokens": first}

    def write(self, batch, counts: dict, t0: float, t1: float, t2: float, t3: float, cut_s: float = 0.0,
              cut_in: bool = False) -> None:
        line = {"t": round(t0, 6), "idle_s": None if self._last_end is None else round(t0 - self._last_end, 6),
                "schedule_s": round(t1 - t0, 6), "model_s": round(t2 - t1 - cut_s, 6), "sample_s": round(t3 - t2, 6),
                "predicted_s": batch.predicted_s and round(batch.predicted_s, 6),
                "limit_s": batch.time_limit_s and round(batch.time_limit_s, 6),
                **counts}
        if cut_s:
            line["cut_s"] = round(cut_s, 6)
        if cut_in:
            line["cut_in"] = True
        if not cut_in:
            self._last_end = t3
        self._file.write(json.dumps(line) + "\n")
        self._steps += 1
        if self._steps % FLUSH_EVERY == 0:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
