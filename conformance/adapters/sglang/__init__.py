"""SGLang (serving): the model-level adapter (adapter.py) over its runtime (runtime.py), stage hooks
(recorder.py), drafting loops (drafting.py) and weight accounting (weights.py); the target capture
(target.py) and server-argument resolution (settings.py) of the wiring and settings checks."""
from conformance.adapters.sglang.adapter import SGLangAdapter

__all__ = ["SGLangAdapter"]
