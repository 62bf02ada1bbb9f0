"""Owns the model weights and the KV-cache pool; turns a scheduled batch into tensors and logits."""
import os

import torch

from kernels.attention import resolve_backend
from workers.engine.config import EngineConfig
from workers.engine.models.config import ModelConfig
from workers.engine.models.llama import AttentionContext
from workers.engine.models.loader import load_model
from workers.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.backend = resolve_backend(self.device, config.attention_backend)
        self.model = load_model(config.model, model_config, self.dtype, self.device, config.max_model_len)
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_budget()
        shape = (self.num_kv_blocks, config.block_size, model_config.num_key_value_heads, model_config.head_dim)
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def bytes_per_block(self) -> int:
        m = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * m.num_hidden_layers * self.config.block_size * m.num_key_value_heads * m.head_dim * element

    def _blocks_from_budget(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        blocks = budget // self.bytes_per_block
        # No point in a pool beyond what max_num_seqs full-length sequences could use.
        cap = self.config.max_num_seqs * -(-self.config.max_model_len // self.config.block_size)
        return max(1, min(int(blocks), cap))

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, list[int]]:
        bs = self.config.block_size
        input_ids, positions, slots, context_lens, cu = [], [], [], [], [0]
        sample_rows = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            cu.append(cu[-1] + n)
            if end == seq.num_tokens:
                sample_rows.append(cu[-1] - 1)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=self.device)

        ctx = AttentionContext(
            backend=self.backend,
            slot_mapping=tensor(slots),
            block_tables=tensor(tables, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            cu_seqlens_q=tensor(cu, torch.int32),
            max_seqlen_q=max(batch.num_new_tokens),
        )
        return tensor(input_ids), tensor(positions), ctx, sample_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Compute the batch's new tokens into the cache; return logits [S, V] for the rows that sample."""
        input_ids, positions, ctx, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, ctx)
        if not sample_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)]).float()
