"""The worker's and the engine's config fields, built from the one settings object (service/ledger/settings.py's
Config). Neither the engine nor the kernels read the environment: what the TIDEPOOL_* engine variables say reaches
EngineConfig from here, and the worker, serve and run-batch flags are laid over it."""


def engine_fields(settings, device: str) -> dict:
    """EngineConfig fields the settings set, with the TIDEPOOL_SLA_* targets laid over the device's defaults."""
    out = settings.engine_fields()
    overrides = settings.sla_overrides()
    if overrides:
        from tidepool.workers.engine.config import sla_targets_for
        out["sla_targets"] = sla_targets_for(device, overrides)
    return out


def worker_fields(settings, device: str) -> dict:
    """WorkerConfig fields from the settings (kind and the in-code knobs are the caller's)."""
    return dict(model=settings.model or "", database_url=settings.database_url, broker_url=settings.broker_url,
                redis_url=settings.redis_url, device=device, name=settings.worker_name or "",
                lease_seconds=settings.lease_seconds, visibility_timeout=settings.visibility_timeout,
                low_water=settings.low_water, metrics_port=settings.metrics_port,
                fair_intake=settings.fair_intake, fair_window=settings.fair_window,
                engine=engine_fields(settings, device))
