"""Registry of the implementations under test: one line per adapter (each imports its implementation
lazily). Everything an area needs to know about an implementation is on its adapter (base.py)."""
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.sglang import SGLangAdapter
from conformance.adapters.speculators import SpeculatorsAdapter

ADAPTERS = {a.name: a for a in (ReferenceAdapter, SpeculatorsAdapter, SGLangAdapter)}
REFERENCE = ReferenceAdapter.name                                  # what every implementation is compared against
IMPLEMENTATIONS = tuple(name for name in ADAPTERS if name != REFERENCE)   # the implementations under test
