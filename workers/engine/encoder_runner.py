"""ModelRunner's counterpart for encoder models (BERT): the weights and no KV pool. Every scheduled input runs whole
in its step (the scheduler never chunks an embedding input) and leaves as a pooled vector in `self.embeddings`."""
import logging
import time
from pathlib import Path

import torch

from tidepool.kernels import cpu_ops
from tidepool.kernels.cpu_linear import fuse_activation, prepack_linears
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.models.bert import POST_OP_NAMES, AttentionPlan, BertConfig, BertModel
from tidepool.workers.engine.models.loader import iter_weights, safetensors_files
from tidepool.workers.engine.pooling import PoolingSpec, embed_rows
from tidepool.workers.engine.models.sharding import Shard
from tidepool.workers.engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


class EncoderRunner:
    kv_cache = False

    def __init__(self, config: EngineConfig, model_config: BertConfig):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        cpu_ops.configure(config.cpu_kernels, config.kernel_cache)
        started = time.perf_counter()
        with torch.device("meta"):
            model = BertModel(model_config)
        model = model.to_empty(device=self.device)
        model.load_weights(iter_weights(safetensors_files(Path(config.model))))
        self.model = model.to(self.dtype).eval()
        log.info("loaded encoder %s (%s, %s) in %.1f s", config.model, self.dtype, self.device,
                 time.perf_counter() - started)
        if self.device.type == "cpu":
            log.info("linear layers on oneDNN with prepacked weights: %d", prepack_linears(self.model))
            fused = 0
            for layer in self.model.layers:      # the activation inside the intermediate matmul
                if fuse_activation(layer.intermediate, POST_OP_NAMES[model_config.hidden_act]):
                    layer.act = torch.nn.Identity()
                    fused += 1
            log.info("activation fused into the intermediate matmul: %d layers", fused)
        self.pooling = PoolingSpec.from_dir(config.model, encoder=True)
        # The scheduler's block book-keeping needs a pool; embedding inputs never take a block of it.
        self.num_kv_blocks = config.blocks_per_sequence
        self.num_host_blocks = 0
        self.group = None
        self.shard = Shard()
        self.decode_graphs = None
        self.prompt_logprobs: list = []
        self.embeddings: list = []

    @property
    def bytes_per_block(self) -> int:
        return self.config.kv_block_bytes

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> None:
        """Compute the batch's inputs; their pooled vectors are left in `self.embeddings` ([(seq, vector)])."""
        ids, positions, lens, rows = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if seq.pooling is not None:
                rows.append((seq, len(ids)))
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            lens.append(n)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            AttentionPlan(lens))
        self.embeddings = embed_rows(hidden, rows, self.pooling) if rows else []
        return None
