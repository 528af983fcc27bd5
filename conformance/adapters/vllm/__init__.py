"""vLLM as a serving implementation under test, in its own environment (adapter.py)."""
from conformance.adapters.vllm.adapter import VLLMAdapter

__all__ = ["VLLMAdapter"]
