"""One tenant cannot exhaust what the others share (OWASP API4, unrestricted resource consumption): web threads,
the ledger's connections and write lock, the web process's memory, the disk the files live on. Each bound is a
clear 4xx in the API's error format."""
import io
import json

from .conftest import Admin

MAX_ERRORS = 100    # service.ledger.batches.MAX_ERRORS


def _upload(client, key, data: bytes, **fields):
    return client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl"), **fields},
                       headers=key, content_type="multipart/form-data")


def test_a_failed_batch_keeps_a_bounded_error_list(any_app):
    """A file of 1,000 bad lines fails with the first 100 errors and one entry counting the rest."""
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    lines = b"".join(b"not json %d\n" % i for i in range(1000))
    f = _upload(client, key, lines).get_json()["id"]
    b = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    assert b["status"] == "failed"
    errors = b["errors"]["data"]
    assert len(errors) == MAX_ERRORS + 1 and errors[0]["line"] == 1 and errors[MAX_ERRORS - 1]["line"] == MAX_ERRORS
    assert errors[-1]["code"] == "too_many_errors" and str(1000 - MAX_ERRORS) in errors[-1]["message"]
