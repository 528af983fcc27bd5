"""speculators (training): the adapter, its stage recorder, and its training path (training.py)."""
from conformance.adapters.speculators.adapter import SpeculatorsAdapter

__all__ = ["SpeculatorsAdapter"]
