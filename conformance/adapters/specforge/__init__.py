"""SpecForge (training): the adapter, its stage recorder, and its CPU shims (shims.py)."""
from conformance.adapters.specforge.adapter import SpecForgeAdapter

__all__ = ["SpecForgeAdapter"]
