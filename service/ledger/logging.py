"""Structured logs: one JSON object per line (plain lines with TIDEPOOL_LOG_FORMAT=text). Lines about a job carry
job_id, tenant and sla_class; API keys, bearer tokens and the admin token are scrubbed from every line."""
import json
import logging
import re
import sys
import time

# Context fields copied from `extra=` onto the JSON line when present.
FIELDS = ("job_id", "batch_id", "tenant", "sla_class", "status", "worker", "actor", "method", "route", "path",
          "http_status", "duration_ms", "attempts", "prompt_tokens", "completion_tokens", "error_code", "event",
          "model", "seconds")
_SECRETS = [
    (re.compile(r"\b(tp_[a-z0-9]{10})_[A-Za-z0-9_\-]+"), r"\1_[redacted]"),  # full API key → its prefix
    (re.compile(r"(?i)\b(bearer)\s+[^\s\"',]+"), r"\1 [redacted]"),
    (re.compile(r"(?i)(admin_token|secret|password|csrf_token)([\"']?\s*[:=]\s*[\"']?)[^\s\"',&]+"),
     r"\1\2[redacted]"),
]
_extra_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """A literal value (the admin token, the session key) never to appear in a log line."""
    if value and len(value) >= 8:
        _extra_secrets.add(value)


def scrub(text: str) -> str:
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    for value in _extra_secrets:
        text = text.replace(value, "[redacted]")
    return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return scrub(json.dumps(line, default=str))


class TextFormatter(logging.Formatter):
    """TIDEPOOL_LOG_FORMAT=text: one plain line (no colours), the context fields as key=value, scrubbed too."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        extra = " ".join(f"{name}={getattr(record, name)}" for name in FIELDS if getattr(record, name, None) is not None)
        line = f"{ts} {record.levelname} {record.name}: {record.getMessage()}" + (f" [{extra}]" if extra else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return scrub(line)


# Third-party loggers that speak at INFO on every request or tick (werkzeug's request lines, Celery beat's
# "Sending due task" every few seconds): kept at WARNING unless TIDEPOOL_LOG_LEVEL is DEBUG.
CHATTY = ("werkzeug", "celery", "kombu", "amqp", "alembic", "waitress", "gunicorn.access")


def _spurious(record: logging.LogRecord) -> bool:
    # kombu warns on every in-process memory:// connection, which has no host by design
    return not record.getMessage().startswith("No hostname was supplied")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (so a replaced stderr never leaves a closed stream here)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def configure(level: str | int | None = None, stream=None, fmt: str | None = None) -> logging.Handler:
    """Send the root logger to JSON lines (TIDEPOOL_LOG_FORMAT=text: plain lines) on stream (stderr), at
    TIDEPOOL_LOG_LEVEL (INFO); idempotent. Every process calls it first (the CLI, gunicorn's app module)."""
    from .settings import log_settings
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h.formatter, (JsonFormatter, TextFormatter))]
    if ours and stream is None:
        return ours[0]
    if level is None or fmt is None:
        env_level, env_fmt = log_settings()
        level, fmt = level or env_level, fmt or env_fmt
    fmt = fmt.lower()
    if fmt not in ("json", "text"):
        raise ValueError(f"TIDEPOOL_LOG_FORMAT must be json or text, got {fmt!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # basicConfig's (and our earlier) stream handlers go; others (a test runner's capture) stay
    root.handlers = [h for h in root.handlers if type(h) is not logging.StreamHandler and h not in ours] + [handler]
    root.setLevel(level)
    debug = logging.getLevelName(root.level) == "DEBUG"
    for name in CHATTY:
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True
        if not debug:
            logger.setLevel(logging.WARNING)
    logging.getLogger("kombu.connection").addFilter(_spurious)
    logging.captureWarnings(True)
    return handler


job_log = logging.getLogger("tidepool.jobs")


def log_job(event: str, job=None, *, job_id: str | None = None, tenant: str | None = None,
            sla_class: str | None = None, level: int = logging.INFO, **fields) -> None:
    """One line about a job: pass the Job row, or its id, tenant and class."""
    if job is not None:
        job_id, tenant = job.id, job.tenant_id
        sla_class = getattr(job.sla_class, "value", job.sla_class)
        fields.setdefault("status", getattr(job.status, "value", job.status))
        if job.batch_id:
            fields.setdefault("batch_id", job.batch_id)
    job_log.log(level, event, extra={"event": event, "job_id": job_id, "tenant": tenant,
                                     "sla_class": sla_class, **fields})
