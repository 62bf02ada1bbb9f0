"""One memory budget for the weights and KV pools of a worker's models (workers/model_workers.py
ModelHost): two random-weight models of different architectures, real Workers over the test ledger and broker,
driven through ModelHost's tick(). A model's pool is sized when it loads: the budget left after the weights, split
by demand (1 + queued + running jobs), never under one full-context sequence, never over the engine's own default;
a model whose weights fit but whose weights and floor pool do not is not loaded; unloading returns its pool."""
import pytest

from tidepool.service.ledger.models import Job, JobStatus
from tidepool.workers.model_workers import ModelHost, engine_config, folder_bytes
from tidepool.workers.worker import WorkerConfig

ADMIN = {"Authorization": "Bearer admin"}
BODY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "sla_class": "batch"}


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    return str(make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen"), arch="qwen2", seed=7,
                               hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2))


class Models:
    """The two models of a test: the deployment's default ("tiny", bare queues) and "qwen" (registered)."""

    def __init__(self, stack, qwen_model):
        r = stack.app.test_client().post("/v1/admin/models", json={"name": "qwen", "source": qwen_model,
                                                                   "tier": "warm"}, headers=ADMIN)
        assert r.status_code == 201, r.get_json()
        self.stack, self.folders = stack, {"tiny": stack.model, "qwen": qwen_model}
        self.default = stack.app.config["TIDEPOOL"].served_model_name
        _, self.key = stack.tenant()

    def cfg(self, name: str, **engine) -> WorkerConfig:
        return WorkerConfig(model=self.folders[name], database_url=self.stack.db_url,
                            broker_url=self.stack.redis_url, redis_url=self.stack.redis_url, device="cpu",
                            name=f"kv.{name}", serves=None if name == "tiny" else "qwen", metrics_port=0,
                            engine={"calibrate": False, "max_num_seqs": 16, **engine})

    def host(self, budget: int, tiers: dict, **engines) -> ModelHost:
        return ModelHost([(n, tiers[n], self.cfg(n, **engines.get(n, {}))) for n in ("tiny", "qwen")],
                         self.stack.redis, budget)

    def submit(self, name: str, n: int) -> list[str]:
        model = {} if name == "tiny" else {"model": "qwen"}
        return self.stack.submit(self.key, n, **model, **BODY)

    def weights(self, name: str) -> int:
        return folder_bytes(self.folders[name])

    def block(self, name: str) -> int:
        return engine_config(self.folders[name], "cpu").kv_block_bytes

    def complete(self, ids: list[str]) -> None:
        self.stack.wait(lambda: self.stack.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids),
                        120, "the jobs to complete")


FLOOR = 1024 // 16      # both models: max_position_embeddings 1024, block_size 16


def blocks(host: ModelHost, name: str) -> int:
    return host.loaded[name][0].engine.runner.num_kv_blocks


def test_the_pool_share_of_the_budget_is_split_by_demand(stack, qwen_model):
    m = Models(stack, qwen_model)
    pools = 6 << 20
    budget = m.weights("tiny") + m.weights("qwen") + pools
    host = m.host(budget, {"tiny": "warm", "qwen": "warm"})
    ids = m.submit("tiny", 3) + m.submit("qwen", 1)          # demand 1 + 3 against 1 + 1
    try:
        host.tick()
        assert set(host.loaded) == {"tiny", "qwen"}
        tiny = pools * 4 // 6 // m.block("tiny")
        assert blocks(host, "tiny") == host.pools["tiny"] == tiny
        assert host.loaded["tiny"][0].engine.runner.bytes_per_block == m.block("tiny")    # the engine's own size
        left = pools - tiny * m.block("tiny")
        assert blocks(host, "qwen") == host.pools["qwen"] == min(pools * 2 // 6, left) // m.block("qwen")
        assert FLOOR < blocks(host, "qwen") < 16 * FLOOR                      # neither the floor nor the ceiling
        ratio = (blocks(host, "tiny") * m.block("tiny")) / (blocks(host, "qwen") * m.block("qwen"))
        assert 1.9 < ratio < 2.1
        assert host.used_bytes() <= budget
        m.complete(ids)                                                       # both engines serve from them
    finally:
        host.stop()


def test_a_model_without_work_gets_one_full_context_sequence(stack, qwen_model):
    m = Models(stack, qwen_model)
    pools = 4 << 20
    budget = m.weights("tiny") + m.weights("qwen") + pools
    host = m.host(budget, {"tiny": "warm", "qwen": "hot"})
    ids = m.submit("tiny", 9)                   # qwen's share, 1/11 of the pools, is under one sequence's blocks
    try:
        host.tick()
        assert pools // 11 < FLOOR * m.block("qwen")
        assert blocks(host, "qwen") == FLOOR and host.loaded["qwen"][0].engine.max_model_len == 1024
        assert blocks(host, "tiny") == (pools - FLOOR * m.block("qwen")) // m.block("tiny")
        m.complete(ids)
    finally:
        host.stop()


def test_a_model_whose_weights_fit_but_not_its_floor_pool_is_not_loaded(stack, qwen_model):
    m = Models(stack, qwen_model)
    tiny_least = m.weights("tiny") + FLOOR * m.block("tiny")
    budget = tiny_least + m.weights("qwen") + FLOOR * m.block("qwen") // 2
    host = m.host(budget, {"tiny": "hot", "qwen": "warm"}, tiny={"max_num_seqs": 1})   # tiny's ceiling: its floor
    ids = m.submit("qwen", 2)
    try:
        host.tick()
        assert list(host.loaded) == ["tiny"] and blocks(host, "tiny") == FLOOR
        assert budget - host.used_bytes() >= m.weights("qwen")                     # the weights alone would fit
        host.tick()
        assert list(host.loaded) == ["tiny"] and host.events == [("load", "tiny")]
        assert stack.count(Job.id.in_(ids), Job.status == JobStatus.queued) == 2     # waiting in its queue
    finally:
        host.stop()


def test_unloading_a_model_returns_its_pool_to_the_next_load(stack, qwen_model):
    m = Models(stack, qwen_model)
    budget = m.weights("qwen") + (3 << 19)        # qwen with a 1.5 MB pool; tiny beside it would not fit
    assert m.weights("qwen") + m.weights("tiny") < budget                 # by weights alone both would
    host = m.host(budget, {"tiny": "warm", "qwen": "warm"})
    try:
        first = m.submit("qwen", 2)
        host.tick()
        assert list(host.loaded) == ["qwen"] and blocks(host, "qwen") == (3 << 19) // m.block("qwen")
        m.complete(first)
        qwen = host.loaded["qwen"][0]
        stack.wait(lambda: not qwen.inflight, 30, "qwen's worker to let its jobs go")
        second = m.submit("tiny", 2)
        host.tick()
        assert host.events == [("load", "qwen"), ("unload", "qwen"), ("load", "tiny")]
        assert set(host.pools) == {"tiny"}
        assert blocks(host, "tiny") == (budget - m.weights("tiny")) // m.block("tiny")
        assert blocks(host, "tiny") * m.block("tiny") > 3 << 19                # more than qwen's pool was
        m.complete(second)
    finally:
        host.stop()


def test_a_worker_serves_only_models_whose_weights_and_floor_pool_fit(tiny_model, qwen_model):
    from tidepool.service.ledger.registry import Entry
    from tidepool.workers.model_workers import fitting_models, min_footprint
    entries = {n: Entry(n, f, "hot", True, 0, True) for n, f in (("tiny", tiny_model), ("qwen", qwen_model))}
    least = {n: min_footprint(e.source, "cpu") for n, e in entries.items()}
    assert least["qwen"] == folder_bytes(qwen_model) + FLOOR * engine_config(qwen_model, "cpu").kv_block_bytes
    weights_only = folder_bytes(tiny_model) + folder_bytes(qwen_model)
    budget = least["tiny"] + folder_bytes(qwen_model)          # both weights fit; qwen's floor pool does not
    assert weights_only <= budget
    assert fitting_models(entries, "tiny", budget) == ["tiny"]
    assert fitting_models(entries, "tiny", least["tiny"] + least["qwen"]) == ["tiny", "qwen"]
    # an operator's fixed pool (--num-kv-blocks) is the floor
    assert fitting_models(entries, "tiny", budget, engine_overrides={"num_kv_blocks": 1}) == ["tiny", "qwen"]
