"""Owns the model weights and the KV-cache pool; turns a scheduled batch into tensors and logits."""
import ctypes
import logging
import os
import time
import weakref

import torch

from tidepool.kernels import cpu_ops
from tidepool.kernels.attention import resolve_backend
from tidepool.kernels.cpu_linear import prepack_linears
from tidepool.kernels.kv_quant import cache_row_width
from tidepool.kernels.paged_attention import SHORT_CHUNK
from tidepool.workers.engine import host_pools, kv_scales
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tidepool.workers.engine.models.model_config import ModelConfig
from tidepool.workers.engine.models.llama import AttentionContext
from tidepool.workers.engine.models.loader import load_model
from tidepool.workers.engine.models.sharding import Shard, head_split, largest_rank_weight_bytes
from tidepool.workers.engine.openmp import team_size
from tidepool.workers.engine.pooling import PoolingSpec, embed_rows
from tidepool.workers.engine.scheduler import ScheduledBatch
from tidepool.workers.engine.swap import HostKVPool, copy_blocks
from tidepool.workers.engine.tensor_parallel import CONTINUE, LORA, MOVE, RUN, start_group

log = logging.getLogger(__name__)
CPU_KV_SHARE = 0.25     # CPU default pool: at most this share of *available* memory (pages touched as blocks
                        # are first written; vLLM-CPU takes 90% of memory by default)


def available_memory() -> int:
    """Bytes the OS could hand out now (MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def trim_heap() -> None:
    """Hand the heap pages start-up freed (weights copied while prepacking, calibration's activations) back to the
    OS, which glibc otherwise keeps: ~200 MB of a SmolLM2-135M engine's RSS. A no-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class DoesNotFit(ValueError):
    """A model whose weights (with one sequence's KV) do not fit one device at its tensor_parallel_size."""


def device_memory(config: EngineConfig) -> int | None:
    """Bytes of one device: device_memory_gib when set, a GPU's total memory, None on the CPU (the host's budget)."""
    if config.device_memory_gib is not None:
        return int(config.device_memory_gib * 2**30)
    device = torch.device(config.device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def _amount(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 // 10 else f"{n / 2**20:.1f} MiB"


def check_fits(config: EngineConfig) -> None:
    """Refuse (DoesNotFit) a model whose largest rank's weights and one max_model_len sequence of KV exceed one
    device, naming the tensor_parallel_size that fits."""
    capacity = device_memory(config)
    if capacity is None:
        return
    m, element = config.model_config, torch.tensor([], dtype=config.torch_dtype).element_size()
    per_head = config.kv_block_bytes // m.kv_heads_per_rank(config.tensor_parallel_size)   # a block of one KV head

    def need(size: int) -> int:
        return (largest_rank_weight_bytes(m, size, element)
                + config.blocks_per_sequence * per_head * m.kv_heads_per_rank(size))
    size = config.tensor_parallel_size
    if need(size) <= capacity:
        return
    fitting = [n for n in m.tensor_parallel_sizes() if n > size and need(n) <= capacity]
    hint = (f"tensor_parallel_size={fitting[0]} fits ({_amount(need(fitting[0]))} a rank)" if fitting else
            "no tensor_parallel_size this model splits over fits")
    raise DoesNotFit(f"model {config.model} needs {_amount(need(size))} a device at tensor_parallel_size={size} "
                     f"(weights and one {config.max_model_len}-token sequence of KV), more than the device's "
                     f"{_amount(capacity)}; {hint}")


def default_kv_blocks(config: EngineConfig, weight_bytes: int = 0) -> tuple[int, str]:
    """The pool an engine sizes for itself when given no num_kv_blocks, and why: kv_cache_memory_bytes, else a
    share of the GPU's free memory, else its part (kv_share) of the host's CPU KV budget, never beyond max_num_seqs
    sequences of max_model_len. The host's budget is CPU_KV_SHARE of the memory available to pools (available now
    plus what the other pools on the host already hold, host_pools) and every CPU pool on the host comes out of it;
    where the others left less than one full-context sequence, the pool gets that one sequence."""
    budget, why, floor = config.kv_cache_memory_bytes, "kv_cache_memory_bytes", 1
    if budget is None:
        device = torch.device(config.device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
            why = f"{config.gpu_memory_utilization:.0%} of free GPU memory"
        else:
            others = host_pools.held_elsewhere()
            host = int((available_memory() + others) * CPU_KV_SHARE)
            budget = min(int(host * config.kv_share), host - others) // config.tensor_parallel_size
            why = f"{CPU_KV_SHARE:.0%} of available memory"
            if config.kv_share < 1:
                why += f", {config.kv_share:.0%} of it"
            if config.tensor_parallel_size > 1:
                why += f", split over {config.tensor_parallel_size} ranks"
            if others:
                why += f", {others / 2**20:.0f} MiB of it held by other pools on this host"
                floor = config.blocks_per_sequence
    if config.device_memory_gib is not None:
        capped = int(config.device_memory_gib * 2**30) - weight_bytes
        if capped < budget:
            budget, why = capped, f"device_memory_gib {config.device_memory_gib:g} less this rank's weights"
    cap = config.max_num_seqs * config.blocks_per_sequence
    if cap <= budget // config.kv_block_bytes:
        return max(1, cap), "max_num_seqs x max_model_len"
    return max(1, min(cap, floor), budget // config.kv_block_bytes), why


class ModelRunner:
    kv_cache = True

    def __init__(self, config: EngineConfig, model_config: ModelConfig, shard: Shard | None = None):
        """shard: this rank's place in a tensor-parallel group (a rank > 0, tensor_parallel.follower_main); None on
        rank 0, which starts the group itself when config.tensor_parallel_size > 1."""
        self.config = config
        self.model_config = model_config
        self.group = None
        if shard is None:
            check_fits(config)
            if config.tensor_parallel_size > 1:
                self.group = start_group(config, self)
                shard = self.group.shard
            else:
                shard = Shard()
        self.shard = shard
        self._forwards = 0       # forwards in flight on this thread (a step cut runs one inside another)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and shard.parallel:
            self.device = torch.device("cuda", shard.rank)
        self.dtype = config.torch_dtype
        self.backend = resolve_backend(self.device, config.attention_backend)
        cpu_ops.configure(config.cpu_kernels, config.kernel_cache)     # before prepacking and the kernel build
        started = time.perf_counter()
        self.model = load_model(config.model, model_config, self.dtype, self.device, config.max_model_len, shard)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())   # tied ones once
        log.info("loaded %s (%s, %s%s) in %.1f s", config.model, self.dtype, self.device,
                 f", rank {shard.rank} of {shard.size}" if shard.parallel else "", time.perf_counter() - started)
        if self.device.type == "cpu":
            log.info("linear layers on oneDNN with prepacked weights: %d", prepack_linears(self.model))
        self.num_kv_blocks, why = ((config.num_kv_blocks, "num_kv_blocks") if config.num_kv_blocks
                                   else default_kv_blocks(config, self.weight_bytes))
        self.largest_rank_weight_bytes = self.weight_bytes
        if shard.parallel:       # one logical pool: every rank holds as many blocks as the smallest can
            blocks = torch.tensor([self.num_kv_blocks], dtype=torch.int64, device=self.device)
            shard.comm.all_reduce(blocks, torch.distributed.ReduceOp.MIN)
            self.num_kv_blocks = int(blocks.item())
            largest = torch.tensor([self.weight_bytes], dtype=torch.int64, device=self.device)
            shard.comm.all_reduce(largest, torch.distributed.ReduceOp.MAX)
            self.largest_rank_weight_bytes = int(largest.item())
        # empty, not zeros: no slot is read before it is written, and on the CPU untouched pages cost no memory
        self.kv_choice = config.kv_choice
        self.kv_dtype = config.kv_storage_dtype
        shape = (self.num_kv_blocks, config.block_size, self.model.layers[0].self_attn.num_kv_heads,
                 cache_row_width(self.kv_dtype, model_config.head_dim))     # a quantized row: codes and its scale
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
            layer.self_attn.v_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        if self.device.type == "cpu":     # out of the host's one KV budget until this runner is collected
            weakref.finalize(self, host_pools.release, host_pools.hold(self.num_kv_blocks * self.bytes_per_block))
        log.info("KV pool: %d blocks of %d tokens = %d tokens, %.0f MiB, %s (%s; max_num_seqs %d, max_model_len %d)",
                 self.num_kv_blocks, config.block_size, self.num_kv_blocks * config.block_size,
                 self.num_kv_blocks * self.bytes_per_block / 2**20, str(self.kv_dtype).removeprefix("torch."), why,
                 config.max_num_seqs, config.max_model_len)
        if self.kv_choice.fallback and shard.rank == 0:
            log.warning("%s", self.kv_choice.fallback)
        if self.kv_choice.quantized:
            self._set_kv_scales(shard)
        self.num_host_blocks = int(config.swap_space_gib * 2**30 // self.bytes_per_block)
        self.host_pool = HostKVPool(self.model.layers, self.num_host_blocks) if self.num_host_blocks else None
        if self.device.type == "cpu" and self.backend == "torch":
            self._prepare_cpu_kernel()
        self.decode_graphs = None
        self.lora = None         # the LLMEngine's LoRAManager when adapters are on (max_loras > 0)
        self.embeddings: list = []       # [(seq, vector)] of the embedding inputs the last run computed
        self._pooling: PoolingSpec | None = None
        if self.device.type == "cuda" and not config.enforce_eager and not shard.parallel:
            self.decode_graphs = self.make_decode_graphs(capture=True)


    def _set_kv_scales(self, shard: Shard) -> None:
        """A quantized pool's scales: the calibration's, else dynamic ones from a probe forward over PROBE_TEXT (on
        every rank alike, so their collectives pair up)."""
        layers, calibration = self.model.layers, self.kv_choice.calibration
        if calibration is not None:
            kv_scales.install(layers, calibration, self.kv_dtype, head_split(self.model_config, shard).kv)
            return
        from tidepool.workers.engine.tokenizer import Tokenizer
        ids = Tokenizer(self.config.model).encode(kv_scales.PROBE_TEXT)
        ids = ids[:min(len(ids), self.num_kv_blocks * self.config.block_size, self.config.max_model_len)]
        n, bs = len(ids), self.config.block_size
        step = dict(input_ids=ids, positions=list(range(n)), slot_mapping=list(range(n)), context_lens=[n],
                    cu_seqlens_q=[0, n], block_tables=[list(range(-(-n // bs)))])
        with kv_scales.AmaxObserver(layers, self.kv_dtype, live=True), torch.inference_mode():
            self._forward(step, n, None)
        if shard.rank == 0:
            log.info("kv_cache_dtype %s without a calibration for %s: dynamic scales per (layer, KV head, channel) from a "
                     "%d-token probe at start (and each cache row's own scale); `tidepool models calibrate-kv` "
                     "measures and stores calibrated ones", self.kv_choice.in_use, self.config.model, n)

    def make_decode_graphs(self, capture: bool, sizes: list[int] | None = None) -> DecodeGraphs:
        """Static decode buffers for a ladder of batch sizes (default: by max_num_seqs); `capture` records a
        CUDA graph per size."""
        max_len = min(self.config.max_model_len, self.num_kv_blocks * self.config.block_size)
        max_blocks = -(-max_len // self.config.block_size)
        sizes = sizes or graph_batch_sizes(self.config.max_num_seqs)
        return DecodeGraphs(self.model, self.backend, sizes, max_blocks,
                            self.model_config.hidden_size, self.dtype, self.device, capture=capture)

    @property
    def pooling(self) -> PoolingSpec:
        """How this decoder embeds (read from its folder when first needed)."""
        if self._pooling is None:
            self._pooling = PoolingSpec.from_dir(self.config.model, encoder=False)
        return self._pooling

    @property
    def bytes_per_block(self) -> int:
        return self.config.kv_block_bytes

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a no-op on the CPU, where every op is synchronous)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prepare_cpu_kernel(self) -> None:
        """Load the native decode kernel now, not on the first request: from the cache at once; its first build on
        this machine runs in the background while decode uses the torch path (cpu_ops.prepare)."""
        head_dim = self.model_config.head_dim
        if not cpu_ops.enabled() or head_dim % 8 or head_dim > 256:
            return
        started = time.perf_counter()
        state = cpu_ops.prepare(background=True)
        if state == "building":
            log.info("native CPU decode kernel: not built on this machine yet; building it in the background (20-50 s "
                     "of one core, once), decode uses the torch path until it is ready")
        elif state == "ready":
            log.info("native CPU decode kernel ready in %.1f s", time.perf_counter() - started)
        else:
            log.info("native CPU decode kernel unavailable (%s): decode uses the torch path",
                     cpu_ops.unavailable_reason())

    def _prepare(self, batch: ScheduledBatch) -> dict:
        """The step's inputs as host lists: new tokens flattened over sequences, and per-sequence tables."""
        bs = self.config.block_size
        step = dict(input_ids=[], positions=[], slot_mapping=[], context_lens=[], cu_seqlens_q=[0],
                    block_tables=[seq.block_table for seq in batch.seqs], sample_rows=[], prompt_rows=[],
                    pool_rows=[])
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            if seq.params.prompt_logprobs is not None:     # position p's logits score prompt token p + 1
                row0 = step["cu_seqlens_q"][-1]
                step["prompt_rows"].extend((row0 + p - start, seq, p)
                                           for p in range(start, min(end, seq.num_prompt_tokens - 1)))
            drafts = seq.draft_token_ids
            tokens = seq.token_ids + drafts if drafts else seq.token_ids
            step["input_ids"].extend(tokens[start:end])
            step["positions"].extend(range(start, end))
            table = seq.block_table
            step["slot_mapping"].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            step["context_lens"].append(end)
            step["cu_seqlens_q"].append(step["cu_seqlens_q"][-1] + n)
            if seq.pooling is not None:      # computed whole in this step (the scheduler never chunks it)
                step["pool_rows"].append((seq, step["cu_seqlens_q"][-2]))
            elif end == len(tokens):       # with drafts, every one of the k + 1 positions is verified
                last = step["cu_seqlens_q"][-1]
                step["sample_rows"].extend(range(last - 1 - len(drafts), last))
        return step

    def _run_eager(self, step: dict, max_seqlen_q: int, between_layers=None) -> torch.Tensor:
        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=self.device)

        tables, context_lens, cu_seqlens_q = step["block_tables"], step["context_lens"], step["cu_seqlens_q"]
        if 1 < max_seqlen_q <= SHORT_CHUNK and self.backend == "torch":
            # Short chunks (a verify step's k + 1 positions, a prompt's last few tokens): row i of a chunk of n
            # over context L attends positions 0 .. L - n + i, which is a decode row with context L - n + i + 1.
            # Attended as decode rows they take the decode kernel, as a step without them would, instead of the
            # per-sequence gather-and-SDPA path that costs a verify step more than its extra rows.
            rows_tables, rows_lens = [], []
            for table, end, a, b in zip(tables, context_lens, cu_seqlens_q, cu_seqlens_q[1:]):
                rows_tables += [table] * (b - a)
                rows_lens += range(end - (b - a) + 1, end + 1)
            tables, context_lens, max_seqlen_q = rows_tables, rows_lens, 1
            cu_seqlens_q = list(range(len(rows_lens) + 1))
        width = max(map(len, tables))
        ctx = AttentionContext(
            backend=self.backend,
            slot_mapping=tensor(step["slot_mapping"]),
            block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            cu_seqlens_q=tensor(cu_seqlens_q, torch.int32),
            max_seqlen_q=max_seqlen_q,
        )
        return self.model(tensor(step["input_ids"]), tensor(step["positions"]), ctx, between_layers)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list) -> list[tuple]:
        """(seq, position, {"token_id", "logprob", "top"}) of prompt token position + 1, per prompt row."""
        rows = torch.tensor([r for r, _, _ in prompt_rows], device=self.device)
        lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
        targets = torch.tensor([seq.token_ids[p + 1] for _, seq, p in prompt_rows], device=self.device)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        k = max(seq.params.prompt_logprobs for _, seq, _ in prompt_rows)
        top_lp, top_ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        out = []
        for i, (_, seq, p) in enumerate(prompt_rows):
            n = seq.params.prompt_logprobs
            out.append((seq, p, {"token_id": seq.token_ids[p + 1], "logprob": chosen[i],
                                 "top": list(zip(top_ids[i][:n], top_lp[i][:n]))}))
        return out

    def _fits_graph(self, batch: ScheduledBatch) -> bool:
        return (self.decode_graphs is not None and max(batch.num_new_tokens) == 1
                and len(batch.seqs) <= self.decode_graphs.max_batch_size)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, between_layers=None) -> torch.Tensor | None:
        """Compute the batch's new tokens into the cache; return logits [S, V] for the rows that sample (k + 1
        consecutive rows for a sequence with k drafts).
        Prompt logprobs asked for (SamplingParams.prompt_logprobs) are left in `self.prompt_logprobs`.
        between_layers(i) is called before each layer i > 0 of an eager forward without adapters (a captured CUDA
        graph runs whole); it may run another batch to its end (LLMEngine's step cut)."""
        if self.group is not None and self.device.type == "cpu" and not self._forwards:
            with team_size(self.group.threads):
                return self._run(batch, between_layers)
        return self._run(batch, between_layers)

    def _run(self, batch: ScheduledBatch, between_layers) -> torch.Tensor | None:
        step = self._prepare(batch)
        adapters = self.lora is not None and self.lora.begin_step(batch.seqs, batch.num_new_tokens)
        if adapters or self._fits_graph(batch):     # the graphs were captured without adapters
            between_layers = None
        if self.group is not None:
            self.group.check()
            self._send_step(step, max(batch.num_new_tokens), between_layers is not None,
                            self.lora.token_slots if adapters else [])
            if between_layers is not None:
                inner = between_layers

                def between_layers(layer: int) -> None:     # the others run what runs here, then go on
                    inner(layer)
                    self.group.channel.send(CONTINUE, fast=True)
        if self._fits_graph(batch) and not adapters:
            hidden = self.decode_graphs.run(step["input_ids"], step["positions"], step["slot_mapping"],
                                            step["context_lens"], step["block_tables"])
        else:
            hidden = self._forward(step, max(batch.num_new_tokens), between_layers)
            if adapters:
                self.lora.end_step()
        self.prompt_logprobs = self._prompt_logprobs(hidden, step["prompt_rows"]) if step["prompt_rows"] else []
        self.embeddings = embed_rows(hidden, step["pool_rows"], self.pooling) if step["pool_rows"] else []
        if not step["sample_rows"]:
            return None
        rows = torch.tensor(step["sample_rows"], device=self.device)
        return self.model.compute_logits(hidden[rows])      # model dtype: the sampler widens it when it must

    def _forward(self, step: dict, max_seqlen_q: int, between_layers) -> torch.Tensor:
        self._forwards += 1
        try:
            return self._run_eager(step, max_seqlen_q, between_layers)
        finally:
            self._forwards -= 1

    # -- tensor parallelism: rank 0 sends, the others follow (tensor_parallel.Follower) ---------------------------
    STEP_LISTS = ("input_ids", "positions", "slot_mapping", "context_lens", "cu_seqlens_q")

    def _send_step(self, step: dict, max_seqlen_q: int, cut: bool, token_slots: list[int]) -> None:
        tables = step["block_tables"]
        width = max(map(len, tables))
        lists = [step[name] for name in self.STEP_LISTS]
        prompt_rows = [r for r, _, _ in step["prompt_rows"]]
        payload = [v for values in lists for v in values]
        for table in tables:
            payload += table + [0] * (width - len(table))
        payload += prompt_rows + step["sample_rows"] + token_slots
        sizes = [len(v) for v in lists] + [len(tables), width, len(prompt_rows), len(step["sample_rows"]),
                                           len(token_slots)]
        self.group.channel.send(RUN, [max_seqlen_q, int(cut), *sizes], payload, fast=self._forwards > 0)

    @torch.inference_mode()
    def follow_step(self, ints: list[int], payload: torch.Tensor, boundary) -> None:
        """A rank > 0: the forward rank 0 announced (_send_step), with its collectives in the same order."""
        max_seqlen_q, cut, *sizes = ints[:2 + len(self.STEP_LISTS) + 5]
        values = payload.tolist()
        step, at = {}, 0
        for name, n in zip(self.STEP_LISTS, sizes):
            step[name], at = values[at:at + n], at + n
        num_tables, width, num_prompt, num_sample, num_slots = sizes[len(self.STEP_LISTS):]
        step["block_tables"] = [values[at + i * width:at + (i + 1) * width] for i in range(num_tables)]
        at += num_tables * width
        prompt_rows, at = values[at:at + num_prompt], at + num_prompt
        sample_rows, at = values[at:at + num_sample], at + num_sample
        token_slots = values[at:at + num_slots]
        if token_slots:
            self.lora.follow_plan(token_slots)
        hidden = self._forward(step, max_seqlen_q, boundary if cut else None)
        if token_slots:
            self.lora.end_step()
        for rows in (prompt_rows, sample_rows):
            if rows:
                self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    def move_blocks(self, swap_out: list, copies: list, swap_in: list) -> None:
        """KV blocks moved for a step, on every rank: device -> host (swap_out), copy-on-write (copies), host ->
        device (swap_in), in that order."""
        if self.group is not None:
            pairs = [swap_out, copies, swap_in]
            self.group.channel.send(MOVE, [len(p) for p in pairs], [v for p in pairs for pair in p for v in pair],
                                    fast=self._forwards > 0)
        self._move(swap_out, copies, swap_in)

    def _move(self, swap_out, copies, swap_in) -> None:
        if swap_out:
            self.host_pool.copy(swap_out, [])
        if copies:     # after swap-outs read their blocks, before swap-ins overwrite any
            copy_blocks(self.model.layers, copies)
        if swap_in:
            self.host_pool.copy([], swap_in)

    def follow_move(self, ints: list[int], payload: torch.Tensor) -> None:
        values, pairs, at = payload.tolist(), [], 0
        for n in ints[:3]:
            pairs.append([(values[at + 2 * i], values[at + 2 * i + 1]) for i in range(n)])
            at += 2 * n
        self._move(*pairs)

    def send_lora_fill(self, slot: int, name: str, path: str) -> None:
        """Rank 0's LoRAManager filled a slot: the others read the same adapter (their slices) into it."""
        text = list(f"{name}\0{path}".encode())
        self.group.channel.send(LORA, [slot], text, fast=self._forwards > 0)

    def follow_lora(self, ints: list[int], payload: torch.Tensor) -> None:
        name, path = bytes(payload.tolist()).decode().split("\0", 1)
        self.lora.follow_fill(ints[0], name, path)
