"""The engine lane's session store (conformance/engine/lane.py), shared by its tests and meta tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine_lane(trained_draft, tmp_path_factory):
    """Each engine group served once per session; an engine still up at the end is shut down."""
    from conformance.engine.lane import EngineLane

    lane = EngineLane(trained_draft, tmp_path_factory.mktemp("engine"))
    yield lane
    lane.close()


@pytest.fixture(scope="session")
def served_lanes(tmp_path_factory):
    """The engine lanes of servers in environments of their own (conformance/engine/served_lane.py): one per engine
    module, each group served once per session."""
    from conformance.engine.served_lane import ServedLane

    lanes = {}

    def lane(engine):
        if engine.NAME not in lanes:
            lanes[engine.NAME] = ServedLane(engine, tmp_path_factory.mktemp(f"{engine.NAME}-engine"))
        return lanes[engine.NAME]
    return lane
