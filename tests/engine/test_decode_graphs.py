"""Decode steps through the static, padded buffers that CUDA graphs replay must change nothing.

On this machine the buffers run the model eagerly (capture=False); on a CUDA machine the last test replays
real captured graphs.
"""
import pytest
import torch

from tidepool.workers.engine import LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.cuda_graphs import graph_batch_sizes

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 16, 40, 256, 1000])
def test_ladder_covers_every_batch_size_up_to_its_top(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(max_num_seqs, 512)
    assert all(s in (1, 2, 4, 8) or s % 16 == 0 or s == sizes[-1] for s in sizes)
    graphs_pad = [next(s for s in sizes if s >= b) - b for b in range(1, sizes[-1] + 1)]
    assert max(graphs_pad) <= 15


def test_decode_through_padded_buffers_matches_eager(tiny_model_dir, random_prompts, run_staggered):
    model_dir = tiny_model_dir("llama-gqa")
    eager = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=12))
    graphed = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=12))
    # A ladder that stops below the batch: steps of 5..12 sequences fall back to eager, smaller ones pad.
    graphed.runner.decode_graphs = graphed.runner.make_decode_graphs(capture=False, sizes=[1, 2, 4])
    prompts = random_prompts(12, eager.config.model_config.vocab_size, seed=21, lengths=(1, 70))
    assert run_staggered(graphed, prompts, GREEDY) == run_staggered(eager, prompts, GREEDY)
    assert graphed.stats()["decode_graph_replays"] > 0
    assert graphed.stats()["kv_blocks_used"] == 0


def test_padding_rows_store_nothing_and_real_rows_match_eager(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), num_kv_blocks=16, block_size=4))
    runner = engine.runner
    graphs = runner.make_decode_graphs(capture=False)
    assert graphs.size_for(3) == 4
    attn = runner.model.layers[0].self_attn
    for layer in runner.model.layers:
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    # three sequences decoding their 6th, 1st and 9th token; tables deliberately not in block order
    step = dict(input_ids=[5, 9, 11], positions=[5, 0, 8], slot_mapping=[7 * 4 + 1, 3 * 4, 2 * 4],
                context_lens=[6, 1, 9], block_tables=[[0, 7], [3], [5, 1, 2]])
    before_k = attn.k_cache.clone()
    with torch.inference_mode():
        hidden = graphs.run(**step)
        assert hidden.shape[0] == 3
        written = before_k.view(-1, *before_k.shape[2:]).ne(attn.k_cache.view(-1, *before_k.shape[2:]))
        assert sorted(written.flatten(1).any(1).nonzero().flatten().tolist()) == sorted(step["slot_mapping"])
        eager = runner._run_eager(dict(step, cu_seqlens_q=[0, 1, 2, 3]), max_seqlen_q=1)
    torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays captured CUDA graphs; needs a GPU")
def test_captured_cuda_graphs_match_eager_on_gpu(tiny_model_dir, random_prompts, run_staggered):
    model_dir = tiny_model_dir("llama-gqa")
    common = dict(model=model_dir, device="cuda", dtype="float32", max_num_seqs=24)
    graphed = LLMEngine(EngineConfig(**common))
    eager = LLMEngine(EngineConfig(**common, enforce_eager=True))
    assert graphed.runner.decode_graphs is not None and eager.runner.decode_graphs is None
    assert sorted(graphed.runner.decode_graphs.graphs) == graph_batch_sizes(24)
    prompts = random_prompts(30, graphed.config.model_config.vocab_size, seed=22, lengths=(1, 200))
    assert run_staggered(graphed, prompts, GREEDY) == run_staggered(eager, prompts, GREEDY)
    assert graphed.stats()["decode_graph_replays"] > 0
