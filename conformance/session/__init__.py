"""The session layer: the stores, the runners, the report and its rendering, the support matrix."""
