"""The ledger core: what the API and the workers share, without Flask.

Models and guarded transitions, admission and quotas, batches, files, tenants and their keys, the model registry,
snapshots, the Celery wire format, the token stream and the settings; the request and response shapes it checks batch
lines with are service/protocol/'s. The rest of `service` is the Flask shell over both; the workers import these two
packages and nothing else of `service` (tests/service/test_isolation_meta.py checks it by folder)."""
