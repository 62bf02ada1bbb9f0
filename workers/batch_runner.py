"""`tidepool run-batch`: an OpenAI Batch input file through the engine, straight to an output file.

Lines are read as they are needed (at most `max_in_flight` lines are read and not yet written), a bad line
becomes an error line (with its custom_id when that could be read) and the rest of the file still runs. Output
lines come in input order.
"""
import json
import time
import uuid
from pathlib import Path

from types import SimpleNamespace

from tidepool.service.protocol import EMBEDDINGS, RESPONSES, openai_responses
from tidepool.service.ledger.batches import ENDPOINTS, check_line
from tidepool.service.protocol.errors import APIError
from tidepool.service.ledger.registry import folder_kind
from tidepool.workers.engine import LLMEngine, RequestOutput
from tidepool.workers.attempt import build_request
from tidepool.workers.openai_bodies import CHAT, ledger_result, response_body


def _error_line(custom_id, code: str, message: str, line: int) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": f"line {line}: {message}"}}


class LineError(ValueError):
    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(code, message)
        self.code, self.message, self.custom_id = code, message, custom_id


def _parse(raw: str, line: int, seen: set[str], kind: str = "generate",
           context_len: int | None = None) -> tuple[str, str, dict]:
    """-> (custom_id, url, checked body); raises LineError (carrying the custom_id once it could be read). A
    /v1/responses body is checked as the chat body it stands for."""
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LineError("invalid_json", f"not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise LineError("invalid_request", "each line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "'custom_id' must be a non-empty string")
    if custom_id in seen:
        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", custom_id)
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        raise LineError("invalid_method", "'method' must be POST", custom_id)
    url = item.get("url")
    if url not in ENDPOINTS:
        raise LineError("invalid_url", f"'url' must be one of {list(ENDPOINTS)}", custom_id)
    if (url == EMBEDDINGS) != (kind == "embed"):
        raise LineError("model_not_supported", f"this model {'embeds' if kind == 'embed' else 'generates'} only: "
                        f"{url} lines cannot run on it", custom_id)
    try:
        body = check_line(url, item.get("body"), served_model=None, max_tokens_cap=None, context_len=context_len).body
    except APIError as exc:
        raise LineError(exc.code or "invalid_request", exc.message, custom_id) from None
    return custom_id, url, body


def count_lines(path: str | Path) -> int:
    """Non-blank lines of the input: the progress bar's total (a quick pass over the bytes)."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def run_batch(engine: LLMEngine, input_path: str | Path, output_path: str | Path, model_name: str,
              max_in_flight: int | None = None, progress: bool = True, adapters: dict | None = None) -> dict:
    """Returns counts: {"total", "completed", "failed", "generated_tokens", "seconds"}. adapters: LoRARequest by
    name: a line whose body names one in `model` runs with it."""
    adapters = adapters or {}
    kind = folder_kind(engine.config.model)
    max_in_flight = max_in_flight or 4 * engine.config.max_num_seqs
    counts = {"total": 0, "completed": 0, "failed": 0, "generated_tokens": 0}
    pending: dict[str, tuple[int, str, str, dict]] = {}   # engine request id -> (input position, custom_id, url, body)
    done: dict[int, dict] = {}                        # finished lines waiting for the ones before them
    next_out = 0                                      # input position of the next line to write
    seen: set[str] = set()
    started = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(desc="run-batch", unit="req", total=count_lines(input_path))

    with open(input_path, encoding="utf-8") as src, open(output_path, "w", encoding="utf-8") as dst:
        def settle(position: int, obj: dict) -> None:
            nonlocal next_out
            done[position] = obj
            while next_out in done:
                dst.write(json.dumps(done.pop(next_out), ensure_ascii=False) + "\n")
                next_out += 1
            if bar is not None:
                bar.update(1)

        def finish(out: RequestOutput) -> None:
            position, custom_id, url, request = pending.pop(out.request_id)
            if url == RESPONSES:
                result = ledger_result(out, engine.tokenizer)
                job = SimpleNamespace(status="completed", request=request, output=result["output"], error=None,
                                      **{k: result[k] for k in ("finish_reason", "prompt_tokens", "completion_tokens")})
                body = openai_responses.render(f"resp_{uuid.uuid4().hex}", job, {}, model=model_name,
                                        created_at=int(time.time()), service_tier="flex", store=False)
            else:
                body = response_body(url, out.request_id, model_name, out, engine.tokenizer, body=request)
            settle(position, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                              "response": {"status_code": 200, "request_id": out.request_id, "body": body},
                              "error": None})
            counts["completed"] += 1

        line_no = 0
        exhausted = False
        while not exhausted or engine.has_unfinished():
            while not exhausted and counts["total"] - next_out < max_in_flight:
                raw = src.readline()
                if not raw:
                    exhausted = True
                    break
                line_no += 1
                if not raw.strip():
                    continue
                position = counts["total"]
                counts["total"] += 1
                try:
                    custom_id, url, body = _parse(raw, line_no, seen, kind, engine.max_model_len)
                    request_id = f"line-{line_no}"     # the input line, as error lines name it
                    runs_as = CHAT if url == RESPONSES else url
                    try:
                        prompt, params = build_request(engine.tokenizer, runs_as, body)
                        engine.add_request(request_id, prompt, params, sla_class="batch",
                                           lora=adapters.get(body.get("model")))
                    except ValueError as exc:
                        raise LineError("invalid_request", str(exc), custom_id) from None
                    pending[request_id] = (position, custom_id, url, body)
                except LineError as exc:
                    settle(position, _error_line(exc.custom_id, exc.code, exc.message, line_no))
                    counts["failed"] += 1
            for out in engine.step():
                counts["generated_tokens"] += len(out.new_token_ids)
                if out.finished:
                    finish(out)
            if bar is not None:
                bar.set_postfix(tok_s=f"{counts['generated_tokens'] / (time.perf_counter() - started):.1f}")
    if bar is not None:
        bar.close()
    counts["seconds"] = round(time.perf_counter() - started, 3)
    return counts
