"""Tidepool's inference engine: continuous batching over a paged KV cache. No Flask, Celery or ledger here."""
from workers.engine.config import EngineConfig
from workers.engine.llm import LLM
from workers.engine.llm_engine import LLMEngine, PromptTooLong, RequestOutput
from workers.engine.lora import LoRAError, LoRARequest
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SLA_CLASSES

__all__ = ["LLM", "LLMEngine", "EngineConfig", "LoRAError", "LoRARequest", "PromptTooLong", "RequestOutput", "SamplingParams", "SLA_CLASSES"]
