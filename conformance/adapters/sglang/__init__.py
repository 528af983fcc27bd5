"""SGLang (serving): the model-level adapter (adapter.py) over its runtime (runtime.py), stage hooks
(recorder.py), drafting loops (drafting.py) and weight accounting (weights.py); besides it, the
target capture (target.py), server-argument resolution (settings.py) and the engine (engine*.py)."""
from conformance.adapters.sglang.adapter import SGLangAdapter

__all__ = ["SGLangAdapter"]
