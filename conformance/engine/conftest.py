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
def engine_lane_of(engine_lane, tmp_path_factory):
    """trainer -> an engine lane serving the tiny draft that trainer's own training path trained (the default
    trainer's is `engine_lane`); each started when first asked for, every engine shut down at the end."""
    from conformance.acceptance.trained_draft import recipe_for, trained_draft
    from conformance.engine.lane import EngineLane

    lanes = {engine_lane.trained.trainer: engine_lane}

    def of(trainer: str):
        if trainer not in lanes:
            root = tmp_path_factory.mktemp(f"engine-{trainer}")
            lanes[trainer] = EngineLane(trained_draft(recipe_for(trainer)), root)
        return lanes[trainer]
    yield of
    for lane in lanes.values():
        if lane is not engine_lane:
            lane.close()


@pytest.fixture(scope="session")
def engine_lane_for(engine_lane, tmp_path_factory):
    """group -> the engine lane serving the trained draft of the group's `draft_layers` (the default lane's recipe in
    that many decoder layers; 1: `engine_lane`); each started when first asked for, every engine shut down at the
    end. A lane serves one engine at a time and shuts it down once served, so lanes never hold two engines."""
    import dataclasses

    from conformance.engine.lane import EngineLane
    from conformance.acceptance.trained_draft import trained_draft

    lanes = {engine_lane.trained.recipe.draft_layers: engine_lane}

    def of(group):
        if group.draft_layers not in lanes:
            recipe = dataclasses.replace(engine_lane.trained.recipe, draft_layers=group.draft_layers)
            root = tmp_path_factory.mktemp(f"engine-{group.draft_layers}-layers")
            lanes[group.draft_layers] = EngineLane(trained_draft(recipe), root)
        return lanes[group.draft_layers]
    yield of
    for lane in lanes.values():
        if lane is not engine_lane:
            lane.close()


@pytest.fixture(scope="session")
def mla_engine_lane(tmp_path_factory):
    """The engine lane serving the NeMo-trained MLA draft (trained_draft.MLA_RECIPE) for its tiny DeepSeek-V3 target
    (scenarios.MLA_GROUPS)."""
    from conformance.acceptance.trained_draft import MLA_RECIPE, trained_draft
    from conformance.engine.lane import EngineLane

    lane = EngineLane(trained_draft(MLA_RECIPE), tmp_path_factory.mktemp("engine-mla"))
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


@pytest.fixture(scope="session")
def gpu_lanes(trained_draft, tmp_path_factory):
    """config -> the CUDA engine lane of that configuration (conformance/engine/gpu_lane.py), each started when first
    asked for; one reference side shared by all, no engine of its own."""
    from conformance.engine.gpu_lane import GpuEngineLane
    from conformance.engine.lane import EngineLane

    shared = EngineLane(trained_draft, tmp_path_factory.mktemp("engine-gpu"))
    lanes = {}

    def of(config):
        if config.id not in lanes:
            lanes[config.id] = GpuEngineLane(shared, config, tmp_path_factory.mktemp(f"engine-gpu-{config.id}"))
        return lanes[config.id]
    yield of
    for lane in lanes.values():
        lane.close()
