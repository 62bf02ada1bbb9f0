"""`tidepool run-batch` end to end on a tiny model, malformed lines included."""
import json

from tidepool.workers.cli import main
from tidepool.workers.engine import LLM, SamplingParams


def test_run_batch_end_to_end(tiny_model_dir, tmp_path, capsys):
    model_dir = tiny_model_dir("llama-gqa")
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a reef fish."}]
    good = {
        "c1": ("/v1/completions", {"prompt": "The tide comes in", "max_tokens": 8, "temperature": 0}),
        "c2": ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "logprobs": 2}),
        "chat1": ("/v1/chat/completions", {"messages": chat, "max_tokens": 6, "temperature": 0}),
    }
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})
             for cid, (url, body) in good.items()]
    lines[1:1] = [
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "x", "temperature": 9}}),
        json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}}),
        json.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": list(range(3, 2000))}}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")

    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", model_dir, "--no-progress"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["total"] == 9 and counts["completed"] == 3 and counts["failed"] == 6

    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == 9
    errors = [o for o in out if o["error"]]
    codes = sorted(o["error"]["code"] for o in errors)
    assert codes == sorted(["invalid_json", "missing_custom_id", "model_not_supported", "invalid_value",
                            "duplicate_custom_id", "context_length_exceeded"])
    assert all(o["response"] is None and "line " in o["error"]["message"] for o in errors)

    results = {o["custom_id"]: o["response"] for o in out if not o["error"]}
    llm = LLM(model_dir)
    tok = llm.tokenizer
    expected = {
        "c1": llm.generate([tok.encode("The tide comes in")], SamplingParams(max_tokens=8, temperature=0))[0],
        "c2": llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, temperature=0))[0],
        "chat1": llm.generate([tok.encode_chat(chat)], SamplingParams(max_tokens=6, temperature=0))[0],
    }
    for cid, ref in expected.items():
        response = results[cid]
        assert response["status_code"] == 200
        body = response["body"]
        usage = body["usage"]
        assert usage == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": len(ref.token_ids),
                         "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}
        choice = body["choices"][0]
        assert choice["finish_reason"] == ref.finish_reason
        if cid == "chat1":
            assert body["object"] == "chat.completion" and choice["message"] == {"role": "assistant",
                                                                               "content": ref.text}
        else:
            assert body["object"] == "text_completion" and choice["text"] == ref.text
    lp = results["c2"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(len(top) == 2 for top in lp["top_logprobs"])


def test_run_batch_keeps_input_order_and_custom_ids(tiny_model_dir, tmp_path, capsys):
    """Long and short requests mixed: the output comes back in input order; an error line carries the custom_id
    whenever the line had a readable one; the progress bar knows the total up front."""
    from tidepool.workers.batch_runner import count_lines
    model_dir = tiny_model_dir("llama-gqa")
    lines = []
    for i in range(12):
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": f"item {i}", "max_tokens": 24 if i % 3 == 0 else 2,
                                          "ignore_eos": True}}))
    lines[4] = json.dumps({"custom_id": "r4", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "x", "temperature": 9}})
    lines[7] = json.dumps({"custom_id": "r7", "method": "GET", "url": "/v1/completions", "body": {}})
    lines[9] = json.dumps({"custom_id": "r9", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": list(range(3, 2000))}})
    lines.insert(5, json.dumps({"custom_id": 17, "method": "POST"}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n\n")
    assert count_lines(src) == 13
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", model_dir, "--no-progress",
                 "--max-num-seqs", "4"]) == 0
    capsys.readouterr()
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(5)] + [None] + [f"r{i}" for i in range(5, 12)]
    errors = {o["custom_id"]: o["error"]["code"] for o in out if o["error"]}
    assert errors == {"r4": "invalid_value", None: "missing_custom_id", "r7": "invalid_method",
                      "r9": "context_length_exceeded"}


def test_run_batch_runs_the_shipped_examples(tiny_model_dir, tmp_path, capsys):
    """examples/requests.jsonl, as the getting-started page runs it: a chat, a completion and a structured-output
    line, each answered; `request_id` names the input line, as error lines do."""
    from pathlib import Path
    examples = Path(__file__).resolve().parents[2] / "examples" / "requests.jsonl"
    dst = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(examples), "-o", str(dst), "--model", tiny_model_dir("llama-gqa"),
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 3
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [(o["custom_id"], o["response"]["request_id"], o["response"]["status_code"], o["error"]) for o in out] == [
        ("chat-1", "line-1", 200, None), ("completion-2", "line-2", 200, None), ("structured-3", "line-3", 200, None)]
    assert [o["response"]["body"]["object"] for o in out] == ["chat.completion", "text_completion", "chat.completion"]
