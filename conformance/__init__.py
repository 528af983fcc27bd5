"""eagle3-conformance: the real EAGLE-3 implementations compared stage by stage against a reference."""
