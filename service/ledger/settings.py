"""Settings: every TIDEPOOL_* variable is read here, from the environment, and nowhere else.

`Config` is one typed, checked dataclass. Each field that a variable sets carries, in its metadata, the variable's
name, the parser of its text, a check of its value and a one-line meaning; `Config.from_env()` builds it once at
start-up and a bad value fails there, naming the variable (SettingsError). A setting has one spelling: field
`num_kv_blocks` is variable `TIDEPOOL_NUM_KV_BLOCKS` and, where a command-line flag sets it, `--num-kv-blocks`
(tests/service/test_settings.py checks it); a variable set under a name in RENAMED stops the process, naming the
new one. The web app's Flask config is this object; the worker's WorkerConfig and the engine's EngineConfig are built
from it by the workers (workers/config_fields.py), so neither the engine nor the kernels read the environment for
Tidepool's knobs. The documentation's configuration page (docs/reference/configuration.md) is generated from
`variables()` by docs/gen_reference.py, and tests/docs keep the two equal."""
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from ..protocol.sla_classes import ONLINE_CLASSES

ONLINE_TARGETS = tuple((c, target) for c in ONLINE_CLASSES for target in ("ttft_ms", "itl_ms"))
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(ValueError):
    """A setting with a bad value; the message starts with the variable's name."""


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/true/yes/on or 0/false/no/off")


def _choice(*options):
    def parse(text: str) -> str:
        if text.strip() not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return text.strip()
    return parse


SPECULATIVE_METHODS = ("none", "ngram", "draft")


def _speculative(text: str) -> str:
    """`method[:num_tokens[:draft_model]]` (the engine's SpeculativeConfig text form), checked here so a bad value
    fails at start-up naming the variable."""
    method, _, rest = text.strip().partition(":")
    num, _, draft = rest.partition(":")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"expected method[:num_tokens[:draft_model]] with method one of {', '.join(SPECULATIVE_METHODS)}")
    if num and (not num.isdigit() or not 1 <= int(num) <= 32):
        raise ValueError("num_tokens must be an integer in [1, 32]")
    if method == "draft" and not draft:
        raise ValueError("method draft needs a draft model folder: draft:<num_tokens>:<folder>")
    return text.strip()


def _pools(text: str) -> str:
    from .fleet import parse_pools
    parse_pools(text)
    return text.strip()


def _level(text: str) -> str:
    if text.strip().upper() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return text.strip().upper()


def _number(kind):
    def parse(text: str):
        try:
            return kind(text.strip())
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None
    return parse


POSITIVE = (lambda v: v > 0, "must be > 0")
AT_LEAST_ONE = (lambda v: v >= 1, "must be >= 1")
NON_NEGATIVE = (lambda v: v >= 0, "must be >= 0")
SHARE = (lambda v: 0 <= v < 1, "must be in [0, 1)")
PORT = (lambda v: 0 <= v < 65536, "must be a port number (0 turns it off)")


def setting(env: str, default, meaning: str, *, parse=str, check=None, shown: str | None = None,
            secret: bool = False, engine: bool = False, flag: str | None = None):
    """A field set by the variable `env` (`TIDEPOOL_` and the field's name): `parse` turns its text into the value
    (ValueError: a bad value), `check` is (predicate, rule) on the value, `shown` the default as the docs state it
    (else the default itself). `engine`: the EngineConfig field of the same name; `flag` (`--` and the field's name,
    dashed): the worker, serve and run-batch command-line flag that wins over the variable (workers/engine_commands.py
    builds the flags from these fields)."""
    return field(default=default, repr=not secret,
                 metadata={"env": env, "parse": parse, "check": check, "meaning": meaning, "shown": shown,
                           "engine": engine or flag is not None, "flag": flag})


INT, FLOAT = _number(int), _number(float)

# Variables that were renamed to their field's name: set under the old name, they stop the process (not ignored).
RENAMED = {"TIDEPOOL_KV_BLOCKS": "TIDEPOOL_NUM_KV_BLOCKS",
           "TIDEPOOL_MAX_BATCHED_TOKENS": "TIDEPOOL_MAX_NUM_BATCHED_TOKENS"}


def _check(f, value) -> None:
    check = f.metadata.get("check")
    if check is not None and value is not None and not check[0](value):
        raise SettingsError(f"{f.metadata['env']} ({f.name}) {check[1]}, got {value!r}")


@dataclass
class Config:
    # ---- where things are -----------------------------------------------------------------------------------
    database_url: str = setting(
        "TIDEPOOL_DATABASE_URL", "", "Ledger database (SQLAlchemy URL); use `postgresql+psycopg://user@host/db` in "
        "production", shown="`sqlite:///<cwd>/var/tidepool.db`")
    database_replica_url: str | None = setting(
        "TIDEPOOL_DATABASE_REPLICA_URL", None, "A read replica of the ledger (SQLAlchemy URL, e.g. a Postgres hot "
        "standby): the job, batch and file listings, the admin panel's listings and dashboard and the usage reports "
        "read from it, so they may lag the primary by the replication delay; everything that writes, and every "
        "read of one object its client just wrote (a job's status, a stream), stays on `TIDEPOOL_DATABASE_URL`",
        shown="unset (everything on the primary)")
    redis_url: str | None = setting(
        "TIDEPOOL_REDIS_URL", None, "Redis used as Celery broker, token stream and rate-limit counters. While Redis "
        "is unreachable, rate limits fail open within a bound: each web process counts them in memory, so a tenant "
        "gets at most (web processes) × its limit; jobs accepted meanwhile are published by the sweeper once Redis "
        "is back. The URL of any node of a Redis Cluster names the cluster (a process asks the node `INFO cluster` when "
        "it first connects): queues, token streams and doorbells then spread over its masters, each queue's keys under "
        "one hash tag (see Scaling). Unset: in-process `memory://` broker and in-memory rate limits",
        shown="unset (embedded mode)",
        check=(lambda v: v.startswith(("redis://", "rediss://", "unix://")), "must be a redis:// URL"))
    storage_dir: str = setting("TIDEPOOL_STORAGE_DIR", "var/storage",
                               "Folder for uploaded and generated files (bytes never go in the database)")
    model: str | None = setting("TIDEPOOL_MODEL", None, "The default model's folder: served under its basename to "
                                "requests that name no `model`, registered or not (see Models); every process of "
                                "a deployment must agree on it")
    served_model_name: str | None = setting("TIDEPOOL_SERVED_MODEL_NAME", None, "Override the served model name",
                                            shown="basename of `TIDEPOOL_MODEL`")
    models_dir: str = setting("TIDEPOOL_MODELS_DIR", "models", "Where `tidepool models pull` writes model folders "
                              "(and `tidepool serve` finds its default model and, at its first start, registers "
                              "every model folder in it)")
    # ---- web ------------------------------------------------------------------------------------------------
    admin_token: str | None = setting("TIDEPOOL_ADMIN_TOKEN", None, "Bearer token for `/v1/admin/*` and the "
                                      "admin panel's sign-in", shown="unset (admin API disabled)", secret=True)
    secret_key: str | None = setting("TIDEPOOL_SECRET_KEY", None, "Key that signs admin-panel sessions",
                                     shown="derived from the admin token", secret=True)
    trusted_proxies: int = setting("TIDEPOOL_TRUSTED_PROXIES", 0, "Reverse proxies in front of the web app whose "
                                   "`X-Forwarded-For` and `X-Forwarded-Proto` are believed: the client's address is "
                                   "the one that many hops from the right (sign-in throttling and logs use it); `0`: "
                                   "the connection's peer is the client", parse=INT, check=NON_NEGATIVE)
    insecure_cookies: bool = setting("TIDEPOOL_INSECURE_COOKIES", False, "`1` drops the Secure flag on the panel "
                                     "cookie (plain-HTTP development only)", parse=_bool)
    metrics_token: str | None = setting("TIDEPOOL_METRICS_TOKEN", None, "Bearer token a scraper sends to the web "
                                        "app's `/metrics` (`Authorization: Bearer <token>`); the admin token is "
                                        "accepted too. With neither set, `/metrics` answers 401",
                                        shown="unset (the admin token)", secret=True)
    metrics_tenant_labels: bool = setting("TIDEPOOL_METRICS_TENANT_LABELS", False, "`1` labels the web app's "
                                          "`/metrics` series by tenant and batch id (quota rejections, batches at "
                                          "risk and their ETA, fair intake); by default they are summed per reason "
                                          "or class", parse=_bool)
    auth_cache_ttl: float = setting("TIDEPOOL_AUTH_CACHE_TTL", 2.0, "Seconds a web process keeps an API key's "
                                    "tenant and quota; `0` reads them on every request (see Accepting a job)",
                                    parse=FLOAT, check=NON_NEGATIVE)
    flex_timeout: float = setting("TIDEPOOL_FLEX_TIMEOUT", 60.0, "Seconds an online request with `service_tier: "
                                  "flex` may wait for its job to start before it is withdrawn and answered 429 "
                                  "`resource_unavailable`", parse=FLOAT, check=POSITIVE)
    mark_interval: float = setting("TIDEPOOL_MARK_INTERVAL", 0.05, "Seconds between a web process's batched "
                                   "writes of `dispatched_at` (see Accepting a job)", parse=FLOAT, check=POSITIVE)
    # ---- workers and upkeep ---------------------------------------------------------------------------------
    worker_name: str | None = setting("TIDEPOOL_WORKER_NAME", None, "A worker's name (heartbeats, ledger); a "
                                      "`--kind auto` process on a GPU host names its cpu worker `<name>-deferrable`",
                                      shown="`<device>-<host>-<pid>` (`cpu-deferrable-<host>-<pid>` for a cpu worker)")
    metrics_port: int | None = setting(
        "TIDEPOOL_METRICS_PORT", None, "First port tried for a worker's `/metrics`; a taken port moves on to the "
        "next free one (shown in the worker's start-up line and heartbeat); `0` turns it off", parse=INT,
        check=PORT, shown="`9101` (gpu), `9102` (cpu)")
    low_water: int = setting("TIDEPOOL_LOW_WATER", 4, "Offline work is pulled while fewer than this many requests "
                             "(plus free slots) wait in the engine", parse=INT, check=AT_LEAST_ONE)
    fair_intake: bool = setting("TIDEPOOL_FAIR_INTAKE", True, "Workers take each class's queued work by tenant "
                                "share (least weighted service first, earliest deadline first within a tenant); "
                                "`0`: oldest message first (FIFO)", parse=_bool)
    fair_window: float = setting("TIDEPOOL_FAIR_WINDOW", 60.0, "Seconds over which a tenant's served tokens decay "
                                 "(time constant) for the fair take", parse=FLOAT, check=POSITIVE)
    lease_seconds: float = setting("TIDEPOOL_LEASE_SECONDS", 60.0, "Job lease; renewed every quarter while running",
                                   parse=FLOAT, check=POSITIVE)
    visibility_timeout: float = setting("TIDEPOOL_VISIBILITY_TIMEOUT", 6 * 3600.0, "Seconds before an unacked "
                                        "message returns to its queue (longer than the longest job)", parse=FLOAT,
                                        check=POSITIVE)
    max_attempts: int = setting("TIDEPOOL_MAX_ATTEMPTS", 3, "Attempts before a job whose lease lapsed is failed",
                                parse=INT, check=AT_LEAST_ONE)
    sweep_interval: float = setting("TIDEPOOL_SWEEP_INTERVAL", 5.0, "Seconds between beat's upkeep passes",
                                    parse=FLOAT, check=POSITIVE)
    republish_after: float = setting("TIDEPOOL_REPUBLISH_AFTER", 30.0, "Seconds before beat republishes a queued "
                                     "job that was never published", parse=FLOAT, check=NON_NEGATIVE)
    beat_schedule: str = setting("TIDEPOOL_BEAT_SCHEDULE", "var/celerybeat-schedule", "Celery beat's schedule file")
    drain_grace_s: float = setting("TIDEPOOL_DRAIN_GRACE_S", 90.0, "Seconds a worker told to stop (SIGTERM) keeps "
                                   "finishing what it runs, taking nothing new, before it hands the rest back to "
                                   "the queue; keep it below the pod's terminationGracePeriodSeconds", parse=FLOAT,
                                   check=NON_NEGATIVE)
    planner_pools: str = setting("TIDEPOOL_PLANNER_POOLS", "gpu=8,cpu=4", "The device kinds the fleet planner sizes "
                                 "a pool of for each enabled model, with each pool's most workers (`kind=max`, kinds "
                                 "`gpu` and `cpu`)", parse=_pools)
    # ---- engine: EngineConfig fields; unset, the engine's own default applies (`shown` states it and
    # tests/workers/test_settings_wiring.py checks that); the worker, serve and run-batch flags win over them 
    num_kv_blocks: int | None = setting("TIDEPOOL_NUM_KV_BLOCKS", None, "KV pool size in blocks", parse=INT,
                                        check=POSITIVE, shown="sized from `max_num_seqs` × `max_model_len`, capped "
                                        "by memory", flag="--num-kv-blocks")
    max_num_seqs: int | None = setting("TIDEPOOL_MAX_NUM_SEQS", None, "Sequences in one batch",
                                       parse=INT, check=POSITIVE, shown="`256`", flag="--max-num-seqs")
    max_num_batched_tokens: int | None = setting("TIDEPOOL_MAX_NUM_BATCHED_TOKENS", None, "Tokens in one engine step",
                                                 parse=INT, check=POSITIVE, shown="`2048`",
                                                 flag="--max-num-batched-tokens")
    max_model_len: int | None = setting("TIDEPOOL_MAX_MODEL_LEN", None, "Longest prompt + output; the API also "
                                        "refuses `max_tokens` past it", parse=INT, check=POSITIVE,
                                        shown="the model's context", flag="--max-model-len")
    tensor_parallel_size: int | None = setting(
        "TIDEPOOL_TENSOR_PARALLEL_SIZE", None, "Ranks each engine's model is sharded over: GPUs, or disjoint sets of "
        "the CPU's cores (a registered model may carry its own: `tidepool models set NAME --tensor-parallel-size N`)",
        parse=INT, check=AT_LEAST_ONE, shown="`1`", flag="--tensor-parallel-size")
    collective_timeout_s: float | None = setting(
        "TIDEPOOL_COLLECTIVE_TIMEOUT_S", None, "Seconds a tensor-parallel rank may take to join a collective before "
        "the group fails (the worker exits and its jobs go back to their queues)", parse=FLOAT, check=POSITIVE,
        shown="`60`", engine=True)
    device_memory_gib: float | None = setting(
        "TIDEPOOL_DEVICE_MEMORY_GIB", None, "Each device's memory, capped (a smaller device simulated): a model whose "
        "largest rank's weights and one `max_model_len` sequence of KV exceed it is refused at start, naming the "
        "`tensor_parallel_size` that fits", parse=FLOAT, check=POSITIVE, shown="the device's own", engine=True)
    kv_cache_dtype: str | None = setting(
        "TIDEPOOL_KV_CACHE_DTYPE", None, "KV cache element type: `auto` (the model's dtype), `fp8_e4m3`, `fp8_e5m2` "
        "or `int8` (8-bit: twice the tokens of a 16-bit cache in the same memory); scales from `tidepool models "
        "calibrate-kv`, else dynamic ones at start; a dtype its calibration refused (over 2 percent lost) keeps the "
        "16-bit cache (a registered model may carry its own: `tidepool models set NAME --kv-cache-dtype D`)",
        parse=_choice("auto", "fp8_e4m3", "fp8_e5m2", "int8"), shown="`auto`", flag="--kv-cache-dtype")
    max_loras: int | None = setting("TIDEPOOL_MAX_LORAS", None, "LoRA adapter slots on the device (`0`: adapters "
                                    "off)", parse=INT, check=NON_NEGATIVE, shown="`0`", engine=True)
    max_lora_rank: int | None = setting("TIDEPOOL_MAX_LORA_RANK", None, "Highest adapter rank the slots hold; a "
                                        "folder of a higher rank is refused at registration", parse=INT,
                                        check=POSITIVE, shown="`16`", engine=True)
    max_cpu_loras: int | None = setting("TIDEPOOL_MAX_CPU_LORAS", None, "Adapters kept in host memory, loaded "
                                        "ones included", parse=INT, check=POSITIVE, shown="2 × `max_loras`",
                                        engine=True)
    attention_backend: str | None = setting("TIDEPOOL_ATTENTION_BACKEND", None, "`torch` or `triton`: force the "
                                            "attention implementation", parse=_choice("torch", "triton"),
                                            shown="by device", engine=True)
    enforce_eager: bool | None = setting("TIDEPOOL_ENFORCE_EAGER", None, "`1` runs GPU decode steps eagerly instead "
                                         "of replaying CUDA graphs", parse=_bool, shown="`0`", engine=True)
    sla_realtime_ttft_ms: float | None = setting(
        "TIDEPOOL_SLA_REALTIME_TTFT_MS", None, "Engine `sla_targets`: first-token bound; without online work a step "
        "is kept within it minus the ITL target, so a realtime prompt arriving mid-step still meets it",
        parse=FLOAT, check=POSITIVE, shown="GPU 200, CPU 600")
    sla_realtime_itl_ms: float | None = setting(
        "TIDEPOOL_SLA_REALTIME_ITL_MS", None, "Engine `sla_targets`: a realtime stream's pace (ms a token since its "
        "first); offline tokens fill a step only as far as every stream stays on pace, or up to the offline floor",
        parse=FLOAT, check=POSITIVE, shown="GPU 50, CPU 60")
    sla_interactive_ttft_ms: float | None = setting(
        "TIDEPOOL_SLA_INTERACTIVE_TTFT_MS", None, "The same first-token bound for interactive work", parse=FLOAT,
        check=POSITIVE, shown="GPU 1000, CPU 2000")
    sla_interactive_itl_ms: float | None = setting(
        "TIDEPOOL_SLA_INTERACTIVE_ITL_MS", None, "The same pace for interactive work", parse=FLOAT,
        check=POSITIVE, shown="GPU 100, CPU 300")
    capacity_policy: str | None = setting("TIDEPOOL_CAPACITY_POLICY", None, "`no_evict` admits a sequence only if "
                                          "it can reach `max_tokens` without evicting anything, and never preempts",
                                          parse=_choice("max_utilization", "no_evict"), shown="`max_utilization`",
                                          engine=True)
    online_reserve: float | None = setting("TIDEPOOL_ONLINE_RESERVE", None, "Share of KV blocks and of "
                                           "`max_num_seqs` only realtime and interactive sequences may take",
                                           parse=FLOAT, check=SHARE, shown="`0.1`", engine=True)
    offline_floor: float | None = setting("TIDEPOOL_OFFLINE_FLOOR", None, "Least share of each engine step's time "
                                          "that waiting offline work gets beside realtime and interactive work (a "
                                          "step that brings an online first token gives it none and owes it); "
                                          "across models sharing one device, the least share of its time one "
                                          "model's offline work gets beside another's online work",
                                          parse=FLOAT, check=SHARE, shown="`0.5`", engine=True)
    step_cut: bool | None = setting("TIDEPOOL_STEP_CUT", None, "`0`: an online request arriving mid-step waits for "
                                    "the step in flight to end; by default, when that step has more than one token "
                                    "gap of the request's class still to run and the request's tenant has no "
                                    "prompt in it, its first-token step runs between two layers of that step",
                                    parse=_bool, shown="`1`", engine=True)
    step_trace: str | None = setting("TIDEPOOL_STEP_TRACE", None, "A file every engine step appends one JSON line "
                                     "to: its time split (schedule, model, sample, idle before it), predicted time "
                                     "and bound, online and offline rows and tokens (a diagnosis of where step time "
                                     "goes)", shown="off", engine=True)
    swap_space_gib: float | None = setting("TIDEPOOL_SWAP_SPACE_GIB", None, "Host pool for KV blocks swapped out "
                                           "under memory pressure (pinned on CUDA)", parse=FLOAT, check=NON_NEGATIVE,
                                           shown="`4` on CUDA, `0` on CPU", engine=True)
    cpu_kernels: bool | None = setting("TIDEPOOL_CPU_KERNELS", None, "`0` keeps the CPU engine on plain torch: decode "
                                "attention, the fused element-wise ops and F.linear instead of the native kernels "
                                "and oneDNN-prepacked linears", parse=_bool, shown="`1`", engine=True)
    kernel_cache: str | None = setting("TIDEPOOL_KERNEL_CACHE", None, "Where the native CPU kernel is built and "
                                       "cached", shown="`~/.cache/tidepool/kernels`", engine=True)
    speculative: str | None = setting(
        "TIDEPOOL_SPECULATIVE", None, "Speculative decoding as `method[:num_tokens[:draft_model]]`: `ngram:4` drafts "
        "up to 4 tokens a step by prompt lookup for sequences where the cost model predicts it pays (online ones "
        "first; offline ones only while it raises throughput); `none` turns it off. A request opts out with "
        "`speculate: false`", parse=_speculative, shown="`none`", engine=True)
    # ---- logs -----------------------------------------------------------------------------------------------
    log_level: str = setting("TIDEPOOL_LOG_LEVEL", "INFO", "Log level (`DEBUG` also lets werkzeug, Celery, kombu "
                             "and alembic speak below WARNING)", parse=_level, check=(lambda v: v in LOG_LEVELS,
                                                                                      "must be a level name"))
    log_format: str = setting("TIDEPOOL_LOG_FORMAT", "json", "`json`: one JSON object per line; `text`: plain "
                              "lines, same fields", parse=_choice("json", "text"),
                              check=(lambda v: v in ("json", "text"), "must be json or text"))
    # ---- set in code only (tests, embedding) ----------------------------------------------------------------
    max_file_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    batch_chunk_size: int = 5_000
    dispatch_chunk_size: int = 1_000
    page_size: int = 20
    online_timeout: float = 600.0     # seconds an online request waits for its job before it is answered 504
    admin_failures_per_minute: int = 10    # wrong admin tokens (panel and bearer) per client address and minute

    def __post_init__(self):
        for f in fields(self):
            _check(f, getattr(self, f.name))
        # Relative paths are resolved once, here, against the start-up directory: Flask's send_file (and any
        # later chdir) would otherwise read them against another folder.
        if not self.database_url:
            Path("var").mkdir(exist_ok=True)
            self.database_url = f"sqlite:///{Path('var/tidepool.db').resolve()}"
        self.storage_dir = str(Path(self.storage_dir).expanduser().resolve())
        if self.model:
            self.model = os.path.abspath(os.path.expanduser(self.model))   # abspath: a symlink keeps its name
        if self.served_model_name is None and self.model:
            self.served_model_name = Path(self.model.rstrip("/")).name or self.model
        for name in ("max_file_bytes", "max_batch_lines", "batch_chunk_size", "dispatch_chunk_size", "page_size",
                     "admin_failures_per_minute"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    @property
    def broker_url(self) -> str:
        return self.redis_url or "memory://"

    def engine_fields(self) -> dict:
        """EngineConfig fields these settings set (unset ones are left to the engine's defaults; the SLA targets,
        which need the device, come separately from sla_overrides)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata.get("engine") and getattr(self, f.name) is not None}

    def sla_overrides(self) -> dict:
        """The TIDEPOOL_SLA_* targets that are set, as {class: {target: ms}} (laid over the device's defaults)."""
        out: dict = {}
        for cls, target in ONLINE_TARGETS:
            value = getattr(self, f"sla_{cls}_{target}")
            if value is not None:
                out.setdefault(cls, {})[target] = value
        return out

    @classmethod
    def env_values(cls, environ=None) -> dict:
        """The fields the environment sets, parsed and checked (no side effects: the CLI calls it before any
        command); SettingsError names the first variable with a bad value, or set under its old name (RENAMED). An
        empty variable counts as unset."""
        environ = os.environ if environ is None else environ
        for old, new in RENAMED.items():
            if (environ.get(old) or "").strip():
                raise SettingsError(f"{old} is now called {new}: set {new} instead")
        values = {}
        for f in fields(cls):
            env = f.metadata.get("env")
            raw = environ.get(env) if env else None
            if raw is None or not raw.strip():
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as exc:
                raise SettingsError(f"{env}: {exc}, got {raw!r}") from None
            _check(f, values[f.name])
        return values

    @classmethod
    def setting(cls, name: str, environ=None):
        """One setting's value from the environment, else its default, without building the whole object (no
        side effects: `tidepool models list` and the log set-up use it)."""
        return cls.env_values(environ).get(name, cls.__dataclass_fields__[name].default)

    @classmethod
    def from_env(cls, overrides: dict | None = None, environ=None) -> "Config":
        """The settings from the environment, with `overrides` (field name -> value) laid over them; a name that is
        not a field is a SettingsError naming it."""
        overrides = overrides or {}
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise SettingsError(f"unknown setting{'s' * (len(unknown) > 1)} {', '.join(unknown)}: not a field of Config")
        return cls(**{**cls.env_values(environ), **overrides})


def variables() -> list[tuple[str, str, str]]:
    """(variable, default as the docs show it, meaning) for every setting, in field order."""
    out = []
    for f in fields(Config):
        if "env" not in f.metadata:
            continue
        shown = f.metadata["shown"]
        if shown is None:
            default = f.default if f.default is not MISSING else None
            shown = ("unset" if default is None else f"`{int(default)}`" if isinstance(default, bool)
                     else f"`{default:g}`" if isinstance(default, float) else f"`{default}`")
        flag = f" (`{f.metadata['flag']}`)" if f.metadata.get("flag") else ""
        out.append((f.metadata["env"], shown, f.metadata["meaning"] + flag))
    return out


# Variables Tidepool documents but does not read itself.
OTHER_VARIABLES = [("PROMETHEUS_MULTIPROC_DIR", "unset",
                    "Empty folder for prometheus-client multiprocess mode under gunicorn")]


def engine_flags() -> list[tuple[str, str, str, str]]:
    """(flag, EngineConfig field, variable, meaning) for the settings a command-line flag overrides."""
    return [(f.metadata["flag"], f.name, f.metadata["env"], f.metadata["meaning"])
            for f in fields(Config) if f.metadata.get("flag")]


def log_settings() -> tuple[str, str]:
    """(TIDEPOOL_LOG_LEVEL, TIDEPOOL_LOG_FORMAT) from the environment, checked."""
    return Config.setting("log_level"), Config.setting("log_format")

