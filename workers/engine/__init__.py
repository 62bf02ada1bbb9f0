"""Tidepool's inference engine: continuous batching over a paged KV cache. No Flask, Celery or ledger here."""
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.llm import LLM
from tidepool.workers.engine.llm_engine import LLMEngine, PromptTooLong, RequestOutput
from tidepool.workers.engine.lora import LoRAError, LoRARequest
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.sequence import SLA_CLASSES

__all__ = ["LLM", "LLMEngine", "EngineConfig", "LoRAError", "LoRARequest", "PromptTooLong", "RequestOutput", "SamplingParams", "SLA_CLASSES"]
