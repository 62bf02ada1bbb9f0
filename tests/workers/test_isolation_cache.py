"""Prefix-cache isolation through the real worker: the namespace comes from the tenant in the ledger (never
from the request), so tenant B never hits tenant A's cached blocks, A still hits its own, and tenants an
admin puts in one prefix_cache_group share."""
from tidepool.workers.worker import Worker, WorkerConfig

PROMPT = list(range(5, 5 + 70))   # token ids: 4 full blocks of 16 and a tail


def _run_one(st, w: Worker, key: str) -> int:
    """Submit PROMPT as key's tenant, run it through the worker; the prefix-cache hits it scored."""
    before = w.engine.stats()["prefix_cache_hits"]
    st.submit(key, 1, prompt=PROMPT, max_tokens=1)
    assert w.pull()
    while w.engine.has_unfinished():
        w.engine_step()
    w.finish_done()
    return w.engine.stats()["prefix_cache_hits"] - before


def test_tenants_hit_only_their_own_or_their_groups_cached_prefixes(stack):
    st = stack
    admin = st.app.test_client()
    headers = {"Authorization": "Bearer admin"}
    tenant = {}
    for name in ("a", "b", "c", "d"):
        tenant[name] = st.tenant(name)
    for name in ("c", "d"):   # the admin opt-in: c and d share cached prefixes
        r = admin.patch(f"/v1/admin/tenants/{tenant[name][0]}", json={"prefix_cache_group": "acme"},
                        headers=headers)
        assert r.status_code == 200 and r.get_json()["prefix_cache_group"] == "acme", r.get_json()
    w = Worker(WorkerConfig(model=st.model, database_url=st.db_url, broker_url=st.redis_url,
                            redis_url=st.redis_url, device="cpu", name="iso", lease_seconds=30,
                            engine={"block_size": 16, "num_kv_blocks": 64}))
    w.connect()
    try:
        hits = [_run_one(st, w, tenant[n][1]) for n in ("a", "b", "a", "c", "d", "b")]
    finally:
        w.close()
    assert hits == [0, 0, 64, 0, 64, 64]   # a, then b misses; a hits its own; c, d share; b its own


def test_a_client_cannot_choose_the_namespace(stack):
    st = stack
    _, key = st.tenant()
    r = st.app.test_client().post("/v1/jobs", json={"prompt": "x", "cache_namespace": "tenant:other"},
                                  headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "cache_namespace"
