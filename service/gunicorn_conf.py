"""gunicorn settings for the Procfile's `web` (`gunicorn -c python:tidepool.service.gunicorn_conf 'tidepool.service.wsgi:app'`):
gunicorn's own lines go through Tidepool's log format, and, with PROMETHEUS_MULTIPROC_DIR, a dead worker's
metrics files are marked dead."""
import os

from gunicorn.glogging import Logger

from tidepool.service.ledger.logging import configure


class JsonLogger(Logger):
    """gunicorn's error and access logs as Tidepool log lines (JSON, or text with TIDEPOOL_LOG_FORMAT=text)."""

    def setup(self, cfg):
        super().setup(cfg)
        configure()
        for logger in (self.error_log, self.access_log):
            logger.handlers = []
            logger.propagate = True


logger_class = JsonLogger

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from tidepool.service.ledger.counters import child_exit  # noqa: F401  (gunicorn hook)
