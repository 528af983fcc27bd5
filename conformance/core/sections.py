"""The report's vocabulary, defined once: its section titles, the outcomes of a comparison, the columns
the check areas fill. The areas write rows through a Recorder (the session's Report) and name their
section here; the session layer (conformance/session/report.py) holds the rows and renders them.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Protocol

PASS, KNOWN, FAIL = "pass", "known divergence", "FAIL"   # the outcomes of a comparison
# The engine lane's accept-length bridge (conformance/engine/bridge.py): its section, chart and plotted columns.
ACCEPT_SECTION = "engine: training accuracy to measured accept length"
ACCEPT_CHART_FILE = "accept_length.png"
ACCEPT_COLUMNS = ("predicted (the trainer's full_acc, all held-out rows)", "measured (the server's own counters)",
                  "simulated (reference, same requests)", "per verify round (the server's accepted drafts)",
                  "training's scores at the engine's rounds")


class Section(StrEnum):
    """The report's sections besides the comparisons: every title is written here once, in the order
    report.md shows them. `Report.add_row` takes only these."""

    # draft forward
    PROPERTY_EXAMPLES = "property examples"
    TREE = "tree drafting"
    REAL_SIZE = "real-size step 0 on CPU (bf16)"
    # a user's draft and what each implementation loaded
    USER_DRAFT = "bring your own draft"
    EFFECTIVE_KNOBS = "effective knobs"
    WEIGHT_ACCOUNTING = "weight accounting"
    WEIGHT_MAP = "weight map (serving engine)"
    # the target side
    WIRING = "wiring"
    WIRING_END_TO_END = "wiring end to end"
    WIRING_SERVERS = "wiring: the same draft config, the layers each server feeds"
    # serving settings
    SETTINGS = "effective serving settings"
    SETTINGS_SEED = "effective serving settings: the seed's command line"
    SETTINGS_MORE_STEPS = "effective serving settings: more steps than trained"
    SETTINGS_NOTHING_REQUESTED = "effective serving settings: nothing requested"
    SETTINGS_SILENT = "effective serving settings: silent behaviours"
    # training accuracy vs accept length
    TRAINED_DRAFT = "trained draft"
    ACCEPT_PREDICTED = "accept length: predicted vs simulated"
    ACCEPT_PER_POSITION = "accept length: per position"
    ACCEPT_ORACLE = "accept length: oracle draft"
    ACCEPT_GENERATIONS = "accept length over whole generations (reference)"
    ACCEPT_PLANTED = "accept length: planted faults"
    # SGLang's serving engine (conformance/engine)
    ENGINE = "engine: served vs reference, per request"
    ENGINE_SERVERS = "engine: server arguments as each server resolved them"   # their timings: Recorder.add_timing
    ENGINE_SHIMS = "engine: scheduler-process shims"
    ENGINE_TREE = "engine: tree rounds vs the exact tree"
    ENGINE_FAULTS = "engine: planted serving faults"
    ENGINE_ACCEPT = ACCEPT_SECTION   # its chart: ACCEPT_CHART_FILE
    # throughput
    THROUGHPUT = "draft throughput (timings: vary run to run)"


class Recorder(Protocol):
    """What a check area writes its rows to (the session's Report)."""

    def add_row(self, section: Section, row: dict) -> None:
        """One row of `section`: JSON-able values; a table in report.md."""
        ...

    def add_timing(self, row: dict) -> None:
        """Wall-clock figures (they vary run to run): timings.json beside the report, never in report.json/md."""
        ...
