"""Prefix caching is per namespace: a request never reuses cached blocks of another namespace (which would
tell its sender, by timing, that someone else sent that prefix), while requests of one namespace still do."""
from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.sequence import Sequence

PROMPT = list(range(1, 70))          # 4 full blocks of 16 plus a tail


def _admit(bm: BlockManager, request_id: str, namespace: str | None) -> Sequence:
    seq = Sequence(request_id, PROMPT, SamplingParams(max_tokens=1), cache_namespace=namespace)
    bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def test_blocks_are_found_only_within_their_namespace():
    bm = BlockManager(64, 16)
    a = _admit(bm, "a1", "tenant:A")
    assert a.num_cached_tokens == 0
    assert _admit(bm, "b1", "tenant:B").num_cached_tokens == 0     # same tokens, other namespace
    assert _admit(bm, "a2", "tenant:A").num_cached_tokens == 64    # own namespace still hits
    assert _admit(bm, "n1", None).num_cached_tokens == 0           # no namespace is a namespace of its own


def test_engine_hits_only_within_a_namespace(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(), device="cpu", num_kv_blocks=64, block_size=16))
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def run(request_id, namespace):
        before = engine.stats()["prefix_cache_hits"]
        engine.add_request(request_id, PROMPT, params, cache_namespace=namespace)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return engine.stats()["prefix_cache_hits"] - before, outs[0].token_ids

    hits_a, out_a = run("a1", "tenant:A")
    hits_b, out_b = run("b1", "tenant:B")
    hits_a2, out_a2 = run("a2", "tenant:A")
    hits_g, _ = run("g1", "group:acme")
    hits_g2, _ = run("g2", "group:acme")
    assert (hits_a, hits_b, hits_a2, hits_g, hits_g2) == (0, 0, 64, 0, 64)
    assert out_a == out_b == out_a2
