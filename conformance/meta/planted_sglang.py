"""A pytest plugin that plants a fault in SGLang's own code for one run of the verdict, through SGLang's own planting
mechanism (its source_patcher; conformance/draft/test_mla_sglang.py plants the same way in-process).

A meta test that runs the verdict as a user does (the entry point, or a preloaded child of it) passes
`-p conformance.meta.planted_sglang` after `--` and the source_patcher config in PLANT_ENV; the patch lives only in
that run's process (a preloaded child is a fork: the parent never sees it). Without PLANT_ENV it does nothing.
"""
from __future__ import annotations

import os

PLANT_ENV = "EAGLE3_CONFORMANCE_PLANTED_SGLANG"
PLUGIN = ("-p", __name__)


def pytest_configure(config) -> None:
    planted = os.environ.get(PLANT_ENV)
    if planted:
        from sglang.srt.debug_utils.source_patcher import apply_patches_from_config

        apply_patches_from_config(planted)
