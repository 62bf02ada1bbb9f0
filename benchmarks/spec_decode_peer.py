"""vLLM-CPU's n-gram speculation beside Tidepool's on spec_decode.py's grounded and chat workloads.

Each engine runs the same chat prompts one at a time (greedy, up to --max-tokens), without and with n-gram
speculation (k = --k), and reports per workload the time per output token (request wall time / tokens), its
ratio with over without speculation, and whether the outputs match. Run each engine in its own venv, one after
the other (the peer venv from ../shared/bench/peer_setup.sh):

    python benchmarks/spec_decode_peer.py --engine tidepool --model models/smollm2-135m
    /tmp/peers/vllm/bin/python benchmarks/spec_decode_peer.py --engine vllm --model /tmp/peers/models/smollm2-135m

One JSON line each.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec_decode import chat_messages, grounded_messages  # noqa: E402
from results import record  # noqa: E402


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def run_tidepool(args, speculative, prompts):
    from tidepool.workers.engine import LLM, SamplingParams
    llm = LLM(args.model, speculative=speculative, max_num_seqs=8)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate([prompts["chat"][0]], SamplingParams(max_tokens=4, temperature=0.0))
    return {name: _one_at_a_time(lambda p: llm.generate([p], params)[0].token_ids, ps) for name, ps in prompts.items()}


def run_vllm(args, speculative, prompts):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt
    kw = {}
    if speculative:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(args.model, dtype="float32", max_model_len=2048, max_num_seqs=8, **kw)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=prompts["chat"][0])], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    return {name: _one_at_a_time(lambda p: list(llm.generate([TokensPrompt(prompt_token_ids=p)], params,
                                                             use_tqdm=False)[0].outputs[0].token_ids), ps)
            for name, ps in prompts.items()}


def _one_at_a_time(generate, prompts):
    per_token, outputs = [], []
    for p in prompts:
        t0 = time.perf_counter()
        out = generate(p)
        per_token.append((time.perf_counter() - t0) / max(1, len(out)))
        outputs.append(out)
    return {"ms_per_token": 1000 * _median(per_token), "outputs": outputs}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("tidepool", "vllm"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--mode", choices=("off", "on"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    prompts = {"grounded": [list(encode(grounded_messages(i))) for i in range(args.requests)],
               "chat": [list(encode(chat_messages(i))) for i in range(args.requests)]}
    if args.mode:       # one mode in this process (vLLM's engine processes are not torn down cleanly in-process)
        runner = run_tidepool if args.engine == "tidepool" else run_vllm
        spec = ({"method": "ngram", "num_tokens": args.k} if args.engine == "tidepool" else True) \
            if args.mode == "on" else None
        print("RESULT " + json.dumps(runner(args, spec, prompts)), flush=True)
        return
    runs = {}
    for mode in ("off", "on"):
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                              text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(json.dumps({"engine": args.engine, "error": (done.stderr or done.stdout)[-2000:]}))
            return
        runs[mode] = json.loads(line[len("RESULT "):])
    off, on = runs["off"], runs["on"]
    result = {"engine": args.engine, "k": args.k}
    for name in prompts:
        a, b = off[name], on[name]
        result[name] = {"ms_per_token": [round(a["ms_per_token"], 1), round(b["ms_per_token"], 1)],
                        "ratio": round(b["ms_per_token"] / a["ms_per_token"], 3),
                        "same_outputs": f"{sum(x == y for x, y in zip(a['outputs'], b['outputs']))}/"
                                        f"{len(a['outputs'])}"}
    print(json.dumps(result))
    record(f"spec_decode_peer-{args.engine}", result)


if __name__ == "__main__":
    main()
