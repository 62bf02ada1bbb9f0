"""EngineConfig.step_trace: one JSON line per step, its rows and tokens adding up to what the engine computed."""
import json

from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_each_step_leaves_a_line_whose_tokens_add_up(tiny_model_dir, tmp_path):
    trace = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), step_trace=str(trace),
                                    max_num_batched_tokens=32))
    engine.add_request("rt", list(range(5, 45)), GREEDY, sla_class="realtime")
    engine.add_request("off", list(range(7, 27)), GREEDY, sla_class="batch")
    while engine.has_unfinished():
        engine.step()
    engine._trace.close()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    stats = engine.stats()
    assert len(lines) == stats["total_steps"]
    online, offline = (sum(x[kind][1] for x in lines) for kind in ("online", "offline"))
    assert online == 40 + 5 and offline == 20 + 5          # a prompt and all but the last token's input
    assert sum(x["online"][2] + x["offline"][2] for x in lines) == stats["total_prompt_tokens"] == 60
    assert sum(x["first_tokens"] for x in lines) == 1      # the realtime prompt's last chunk, once
    assert all(x["model_s"] > 0 and (x["idle_s"] is None or x["idle_s"] >= 0) for x in lines)
    assert lines[0]["idle_s"] is None and all(x["t"] < y["t"] for x, y in zip(lines, lines[1:]))
