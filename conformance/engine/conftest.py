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
