"""NeMo Automodel 0.7.0's EAGLE-3 trainer: its Llama-layout draft, its TTT forward and its checkpoints."""
from conformance.adapters.nemo.adapter import NemoAdapter

__all__ = ["NemoAdapter"]
