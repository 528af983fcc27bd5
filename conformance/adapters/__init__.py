"""Registry of the implementations under test: one line per adapter (each imports its implementation
lazily). Everything an area needs to know about an implementation is on its adapter (base.py)."""
from conformance.adapters.base import lane_of
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.sglang import SGLangAdapter
from conformance.adapters.specforge import SpecForgeAdapter
from conformance.adapters.speculators import SpeculatorsAdapter
from conformance.adapters.vllm import VLLMAdapter

ADAPTERS = {a.name: a for a in (ReferenceAdapter, SpeculatorsAdapter, SGLangAdapter, SpecForgeAdapter, VLLMAdapter)}
REFERENCE = ReferenceAdapter.name                                  # what every implementation is compared against
# Every implementation under test, and those of them whose tests run in the default lane (the others run in a
# lane of their own, e.g. `pytest -m vllm`: their adapter's `lane`; loops inside default-lane tests use these).
ALL_IMPLEMENTATIONS = tuple(name for name in ADAPTERS if name != REFERENCE)
IMPLEMENTATIONS = tuple(name for name in ALL_IMPLEMENTATIONS if lane_of(ADAPTERS[name]) == "cpu")
