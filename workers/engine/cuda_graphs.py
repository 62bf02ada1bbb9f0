"""Decode steps replayed from CUDA graphs captured for a ladder of batch sizes, as vLLM and nano-vllm do.

A decode step of B sequences (one new token each) runs the graph of the smallest captured size >= B: the
step's inputs are copied into static buffers, rows B.. of the graph are padding (slot -1 stores nothing,
context 0 attends to nothing) and the hidden states of rows :B are read back. Prefills, mixed steps and
batches above the ladder run eagerly.

Without `capture` the same static buffers and padding run the model eagerly; that is how the padding is
tested on machines without a GPU.
"""
import bisect

import torch

from tidepool.workers.engine.models.llama import AttentionContext

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to min(max_num_seqs, limit) (which is always included)."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16))
    return sizes + [top]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: str, sizes: list[int], max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, capture: bool = True):
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.backend, self.sizes = model, backend, sorted(sizes)
        top = self.sizes[-1]
        ints = dict(device=device, dtype=torch.int32)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(top, **ints)
        self.block_tables = torch.zeros(top, max_blocks_per_seq, **ints)
        self.cu_seqlens_q = torch.arange(top + 1, **ints)
        self.hidden = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        if capture:
            self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, size: int) -> torch.Tensor:
        ctx = AttentionContext(backend=self.backend, slot_mapping=self.slot_mapping[:size],
                               block_tables=self.block_tables[:size], context_lens=self.context_lens[:size],
                               cu_seqlens_q=self.cu_seqlens_q[:size + 1], max_seqlen_q=1)
        return self.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def _capture(self) -> None:
        # Buffers hold padding only (slot -1, context 0): neither warm-up nor capture touches the KV cache.
        pool = None
        for size in reversed(self.sizes):           # largest first, so smaller graphs reuse its memory
            self.hidden[:size] = self._forward(size)     # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = self._forward(size)
            pool = pool or graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], context_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step of B <= max_batch_size sequences."""
        n = len(input_ids)
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"decode batch of {n} exceeds the largest graph ({self.max_batch_size})")

        def fill(buffer: torch.Tensor, values, pad: int) -> None:
            buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(pad)

        fill(self.input_ids, input_ids, 0)
        fill(self.positions, positions, 0)
        fill(self.slot_mapping, slot_mapping, -1)
        fill(self.context_lens, context_lens, 0)
        width = max(map(len, block_tables))
        self.block_tables[:size].zero_()
        self.block_tables[:n, :width].copy_(
            torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32))
        if self.graphs:
            self.graphs[size].replay()
        else:
            self.hidden[:size] = self._forward(size)
        self.replays += 1
        return self.hidden[:n]
