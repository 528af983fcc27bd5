"""The suite's pytest wiring lives in conformance/plugin.py, so that the installed package carries it too."""
pytest_plugins = ("conformance.plugin",)
