"""A Redis outage (Redis taken away behind a proxy) does not break rate-limited tenants: the limits fail open
within a bound (each web process counts them in memory meanwhile), so requests keep getting 202, and 429 past
the limit, never a 5xx; unlimited tenants are unaffected; after the outage Redis counts again."""
import time

import pytest

from tidepool.service import create_app

from ..tcp_proxy import TcpProxy
from .conftest import ADMIN, Admin

BODY = {"prompt": "Hello", "max_tokens": 4}


@pytest.fixture
def redis_outage(pg_url, redis_url, tmp_path):
    hostport, db = redis_url.split("://", 1)[1].split("/", 1)
    host, port = hostport.split(":")
    proxy = TcpProxy(host, int(port)).start()
    app = create_app({"database_url": pg_url, "redis_url": f"redis://127.0.0.1:{proxy.port}/{db}",
                      "admin_token": ADMIN, "storage_dir": str(tmp_path / "storage")})
    yield app, proxy
    proxy.stop()
    app.services.database.dispose()


def test_rate_limits_fail_open_within_a_bound_while_redis_is_down(redis_outage):
    app, proxy = redis_outage
    if time.time() % 60 > 45:      # the counts below are per one-minute window: start at a fresh one
        time.sleep(60.5 - time.time() % 60)
    client = app.test_client()
    admin = Admin(client)
    _, limited = admin.tenant(requests_per_minute=5)
    _, unlimited = admin.tenant()
    assert client.post("/v1/jobs", json=BODY, headers=limited).status_code == 202   # counted in Redis
    proxy.stop()
    codes = [client.post("/v1/jobs", json=BODY, headers=limited).status_code for _ in range(7)]
    assert codes == [202] * 5 + [429]  * 2      # this process alone counts 5 more: the bound is per process
    assert [client.post("/v1/jobs", json=BODY, headers=unlimited).status_code for _ in range(5)] == [202] * 5
    r = client.post("/v1/completions", json={**BODY, "stream": False}, headers=limited)
    assert r.status_code == 429 and "Retry-After" in r.headers
    proxy.start()
    # Redis counts again: 1 request recorded there before the outage, so 4 more fit this window
    codes = [client.post("/v1/jobs", json=BODY, headers=limited).status_code for _ in range(5)]
    assert codes == [202] * 4 + [429]
