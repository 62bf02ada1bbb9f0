"""The padded static buffers CUDA graphs replay, run through the Triton kernels (interpreted on the CPU): the
padding rows (slot -1, context 0) must neither write the cache nor disturb the real rows."""
import pytest
import torch

from tidepool.workers.engine import LLMEngine
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("graphs"), seed=2, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=1, init_std=0.08)
    device = "cpu" if not torch.cuda.is_available() else "cuda"
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32", attention_backend="triton",
                                  num_kv_blocks=12, block_size=4, max_num_seqs=8, enforce_eager=True))


def test_padded_decode_through_triton_matches_eager(engine):
    runner = engine.runner
    graphs = runner.make_decode_graphs(capture=False)
    attn = runner.model.layers[0].self_attn
    with torch.inference_mode():
        attn.k_cache.normal_()
        attn.v_cache.normal_()
        step = dict(input_ids=[5, 9, 11], positions=[5, 0, 8], slot_mapping=[7 * 4 + 1, 3 * 4, 2 * 4],
                    context_lens=[6, 1, 9], block_tables=[[0, 7], [3], [5, 1, 2]])
        assert graphs.size_for(3) == 4
        before = attn.k_cache.clone()
        hidden = graphs.run(**step).clone()
        written = before.flatten(0, 1).ne(attn.k_cache.flatten(0, 1)).flatten(1).any(1)
        assert sorted(written.nonzero().flatten().tolist()) == sorted(step["slot_mapping"])
        eager = runner._run_eager(dict(step, cu_seqlens_q=[0, 1, 2, 3]), max_seqlen_q=1)
        runner.backend = "torch"
        reference = runner._run_eager(dict(step, cu_seqlens_q=[0, 1, 2, 3]), max_seqlen_q=1)
        runner.backend = "triton"
    torch.testing.assert_close(hidden, eager, atol=2e-5, rtol=0)
    torch.testing.assert_close(hidden, reference, atol=2e-5, rtol=0)
