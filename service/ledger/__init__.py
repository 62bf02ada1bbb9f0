"""The ledger core: what the API and the workers share, without Flask.

Models and guarded transitions, admission and quotas, batches, files, the model registry, snapshots, the wire
format, the token stream and the settings. The rest of `service` is the Flask shell over it; the workers import
this package and nothing else of `service` (tests/service/test_isolation_meta.py checks it by folder)."""
