"""`tidepool run-batch`: an OpenAI Batch input file through the engine, straight to an output file.

Lines are read as they are needed (at most `max_in_flight` requests sit in the engine), a bad line
becomes an error line and the rest of the file still runs.
"""
import json
import time
import uuid
from pathlib import Path

from service.bodies import ENDPOINTS, check
from service.errors import APIError
from workers.engine import LLMEngine, RequestOutput
from workers.openai_bodies import prompt_ids, response_body, sampling_params


def _error_line(custom_id, code: str, message: str, line: int) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": f"line {line}: {message}"}}


def _parse(raw: str, line: int, seen: set[str]) -> tuple[str, str, dict]:
    """-> (custom_id, url, checked body); raises ValueError(code, message)."""
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError("invalid_json", f"not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError("invalid_request", "each line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("missing_custom_id", "'custom_id' must be a non-empty string")
    if custom_id in seen:
        raise ValueError("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        raise ValueError("invalid_method", "'method' must be POST")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise ValueError("invalid_url", f"'url' must be one of {list(ENDPOINTS)}")
    try:
        body = check(item.get("body"), url, served_model=None, max_tokens_cap=None).body
    except APIError as exc:
        raise ValueError(exc.code or "invalid_request", exc.message) from None
    return custom_id, url, body


def run_batch(engine: LLMEngine, input_path: str | Path, output_path: str | Path, model_name: str,
              max_in_flight: int | None = None, progress: bool = True) -> dict:
    """Returns counts: {"total", "completed", "failed", "generated_tokens", "seconds"}."""
    max_in_flight = max_in_flight or 4 * engine.config.max_num_seqs
    counts = {"total": 0, "completed": 0, "failed": 0, "generated_tokens": 0}
    pending: dict[str, tuple[str, str]] = {}       # engine request id -> (custom_id, url)
    seen: set[str] = set()
    started = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(desc="run-batch", unit="req")

    with open(input_path, encoding="utf-8") as src, open(output_path, "w", encoding="utf-8") as dst:
        def write(obj: dict) -> None:
            dst.write(json.dumps(obj, ensure_ascii=False) + "\n")

        def finish(out: RequestOutput) -> None:
            custom_id, url = pending.pop(out.request_id)
            body = response_body(url, out.request_id, model_name, out, engine.tokenizer)
            write({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                   "response": {"status_code": 200, "request_id": out.request_id, "body": body}, "error": None})
            counts["completed"] += 1

        line_no = 0
        exhausted = False
        while not exhausted or engine.has_unfinished():
            while not exhausted and len(pending) < max_in_flight:
                raw = src.readline()
                if not raw:
                    exhausted = True
                    break
                line_no += 1
                if not raw.strip():
                    continue
                counts["total"] += 1
                custom_id = None
                try:
                    custom_id, url, body = _parse(raw, line_no, seen)
                    request_id = f"req-{line_no}"
                    engine.add_request(request_id, prompt_ids(url, body, engine.tokenizer),
                                       sampling_params(url, body), sla_class="batch")
                    pending[request_id] = (custom_id, url)
                except ValueError as exc:
                    code, message = exc.args if len(exc.args) == 2 else ("invalid_request", str(exc))
                    write(_error_line(custom_id, code, message, line_no))
                    counts["failed"] += 1
                    if bar is not None:
                        bar.update(1)
            for out in engine.step():
                counts["generated_tokens"] += len(out.new_token_ids)
                if out.finished:
                    finish(out)
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix(tok_s=f"{counts['generated_tokens'] / (time.perf_counter() - started):.1f}")
    if bar is not None:
        bar.close()
    counts["seconds"] = round(time.perf_counter() - started, 3)
    return counts
