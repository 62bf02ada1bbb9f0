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
                drain_grace_s=settings.drain_grace_s, engine=engine_fields(settings, device))


def model_engine_fields(entry) -> dict:
    """EngineConfig fields a registered model carries itself (service/ledger/registry.py Entry), laid over the
    settings' and the flags': its own tensor_parallel_size and kv_cache_dtype, when it has them, and its KV
    calibration (`tidepool models calibrate-kv`), which the engine otherwise reads from the model folder."""
    own = {"tensor_parallel_size": getattr(entry, "tensor_parallel_size", None),
           "kv_cache_dtype": getattr(entry, "kv_cache_dtype", None),
           "kv_cache_calibration": getattr(entry, "kv_cache_calibration", None)}
    return {k: v for k, v in own.items() if v}


def refuse_unstartable(model: str, device: str, fields: dict, command: str) -> None:
    """Stop `tidepool COMMAND` in one line (SystemExit) when its engine would not start: an EngineConfig the engine
    refuses (a tensor_parallel_size the model does not split over, more ranks than devices, no config.json) or a
    model whose largest rank does not fit one device (model_runner.DoesNotFit, which names the size that fits).
    Reads config.json only: no weights load and no rank starts."""
    from tidepool.workers.engine import EngineConfig
    from tidepool.workers.engine.model_runner import DoesNotFit, check_fits
    try:
        check_fits(EngineConfig(model=model, device=device, **fields))
    except DoesNotFit as exc:
        raise SystemExit(f"tidepool {command}: {exc}: set --tensor-parallel-size, TIDEPOOL_TENSOR_PARALLEL_SIZE or a "
                         "registered model's own (tidepool models set NAME --tensor-parallel-size N)") from None
    except (ValueError, OSError) as exc:
        raise SystemExit(f"tidepool {command}: {exc}") from None
