"""Service configuration: one typed dataclass, read from the environment and checked when built."""
import json
import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path

SLA_CLASSES = ("realtime", "interactive", "batch", "deferrable")


@dataclass
class Config:
    database_url: str = ""
    redis_url: str | None = None
    storage_dir: str = "var/storage"
    admin_token: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    max_file_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    batch_chunk_size: int = 5_000
    dispatch_chunk_size: int = 1_000
    page_size: int = 20
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
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
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"TIDEPOOL_REDIS_URL must be a redis:// URL, got {self.redis_url!r}")
        for name in ("max_file_bytes", "max_batch_lines", "batch_chunk_size", "dispatch_chunk_size", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @cached_property
    def context_len(self) -> int | None:
        """Longest prompt + output the workers accept: TIDEPOOL_MAX_MODEL_LEN, else the model's own context (its
        config.json, capped at a sliding window); None when the model folder cannot be read here."""
        if os.environ.get("TIDEPOOL_MAX_MODEL_LEN"):
            return int(os.environ["TIDEPOOL_MAX_MODEL_LEN"])
        if not self.model:
            return None
        try:
            raw = json.loads((Path(self.model) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        limits = [raw.get("max_position_embeddings"), raw.get("sliding_window")]
        return min((v for v in limits if isinstance(v, int) and v > 0), default=None)

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    @property
    def broker_url(self) -> str:
        return self.redis_url or "memory://"

    @classmethod
    def from_env(cls, overrides: dict | None = None) -> "Config":
        env = os.environ
        values = {
            "database_url": env.get("TIDEPOOL_DATABASE_URL", ""),
            "redis_url": env.get("TIDEPOOL_REDIS_URL") or None,
            "storage_dir": env.get("TIDEPOOL_STORAGE_DIR", "var/storage"),
            "admin_token": env.get("TIDEPOOL_ADMIN_TOKEN") or None,
            "model": env.get("TIDEPOOL_MODEL") or None,
            "served_model_name": env.get("TIDEPOOL_SERVED_MODEL_NAME") or None,
        }
        known = {f.name for f in fields(cls)}
        for key, value in (overrides or {}).items():
            if key in known:
                values[key] = value
        return cls(**values)
