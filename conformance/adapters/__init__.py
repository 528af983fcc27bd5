"""Registry of the implementations under test; each adapter imports its implementation lazily."""
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.sglang.draft import SGLangAdapter
from conformance.adapters.speculators import SpeculatorsAdapter

ADAPTERS = {a.name: a for a in (ReferenceAdapter, SpeculatorsAdapter, SGLangAdapter)}
IMPLEMENTATIONS = ("speculators", "sglang")   # compared against the reference
