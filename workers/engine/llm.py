"""LLM: the offline entry point. Submit a list of prompts, get their outputs back in order."""
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.llm_engine import LLMEngine, RequestOutput
from tidepool.workers.engine.pooling import PoolingParams
from tidepool.workers.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, device: str = "cpu", dtype: str | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, tensor_parallel_size: int = 1,
                 **kwargs):
        """tensor_parallel_size: shard the model over this many ranks (GPUs, or disjoint sets of the CPU's cores)."""
        # Only offline work comes through here: hold nothing back for online work, and bound no step in time for it.
        kwargs.setdefault("online_reserve", 0.0)
        kwargs.setdefault("sla_targets", {})
        self.engine = LLMEngine(EngineConfig(
            model=str(model), device=device, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """lora_request: a workers.engine.lora.LoRARequest for every prompt, or a list of one (or None) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params list must match prompts in length")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request list must match prompts in length")
        ids = []
        for prompt, p, lora in zip(prompts, params, loras):
            request_id = f"gen-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, p, sla_class="batch", lora=lora)
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        generated = 0
        while len(results) < len(ids):
            for out in self.engine.step():
                generated += len(out.new_token_ids)
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix(tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.0f}")
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def embed(self, inputs: list[str] | list[list[int]] | str, pooling_params: PoolingParams | None = None,
              per_request: int = 1) -> list[list[float]]:
        """One vector per input (text or token ids), in order; `per_request` inputs share one engine request."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        params = pooling_params or PoolingParams()
        ids = []
        for start in range(0, len(inputs), per_request):
            request_id = f"emb-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, inputs[start:start + per_request], params, sla_class="batch")
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [vector for i in ids for vector in results[i].embeddings]

    def chat(self, conversations: list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = [self.tokenizer.encode_chat(messages) for messages in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
