"""Self-tests of the vLLM lane: the harness around vLLM's draft (its worker, its shims) and the lane split.

Planted harness faults in the worker must show as a divergence at attention, where they act: the KV-write
shim writing each row one slot on, and requests given vLLM's null block 0 (worker.py: tables start at 1).
The same draft without a plant conforms. These run in the vLLM lane (parametrized with the adapter).
The lane split itself (conformance/plugin.py own_lanes) runs in the default lane, on stand-in items.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.adapters.base import lane_of
from conformance.core.compare import compare_traces
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

OWN_LANE = [name for name, adapter in ADAPTERS.items() if lane_of(adapter) != "cpu"]
CASE = CASES_BY_ID["gqa"]


@pytest.mark.parametrize("impl", [name for name in OWN_LANE if hasattr(ADAPTERS[name], "served_boundaries")])
@pytest.mark.parametrize("plant", ["kv_write_next_slot", "null_block"])
def test_a_planted_harness_fault_shows_at_attention(impl, plant, drafts, repro):
    adapter = ADAPTERS[impl]()
    loaded = adapter.load(drafts.checkpoint(CASE)[adapter.checkpoint_format], torch.float32)
    expected = drafts.trace("reference", CASE, torch.float32, 2)
    clean = compare_traces(loaded.run(drafts.batch(CASE, 2), 2), expected, CASE.id)
    assert clean.first_divergence is None, clean.message(repro)
    planted = compare_traces(loaded.run(drafts.batch(CASE, 2), 2, plant=plant), expected, CASE.id)
    first = planted.first_divergence
    assert first is not None and first.stage == "layers.0.attn_core", (
        f"planted {plant} not caught at attention:\n{planted.message(repro)}")


class StandInItem:
    """What own_lanes reads and writes of a pytest item: its parameters and its marker walk (a `cpu` mark set
    on the module, as pytestmark does, and one on the function)."""

    def __init__(self, impl: str):
        self.callspec = SimpleNamespace(params={"impl": impl})
        self.own_markers = [pytest.mark.cpu.mark]
        self.module_markers = [pytest.mark.cpu.mark, pytest.mark.meta.mark]

    def iter_markers_with_node(self, name=None):
        return ((self, m) for m in [*self.own_markers, *self.module_markers] if name is None or m.name == name)

    def add_marker(self, marker):
        self.own_markers.append(marker.mark)

    def names(self) -> set[str]:
        return {m.name for _, m in self.iter_markers_with_node()}


@pytest.mark.parametrize("missing", [False, True], ids=["environment_present", "environment_missing"])
def test_an_own_lane_test_leaves_the_default_lane(missing, monkeypatch, tmp_path):
    from conformance.plugin import own_lanes

    if not OWN_LANE:
        pytest.skip("no adapter has a lane of its own")
    impl, default = OWN_LANE[0], next(n for n, a in ADAPTERS.items() if lane_of(a) == "cpu")
    monkeypatch.setattr(ADAPTERS[impl], "missing", classmethod(lambda cls: "planted: environment missing"
                                                               if missing else None))
    config = SimpleNamespace(lines=[], addinivalue_line=lambda name, line: config.lines.append(line))
    own, other = StandInItem(impl), StandInItem(default)
    own_lanes(config, [own, other])
    lane = lane_of(ADAPTERS[impl])
    assert "cpu" not in own.names() and lane in own.names(), own.names()   # -m cpu never selects it
    assert other.names() == {"cpu", "meta"}, other.names()                 # the default lane is untouched
    assert any(line.startswith(f"{lane}:") for line in config.lines)        # registered (--strict-markers)
    skips = [m for m in own.own_markers if m.name == "skip"]
    assert [m.kwargs["reason"] for m in skips] == (["planted: environment missing"] if missing else [])


@pytest.mark.parametrize("impl", [name for name in OWN_LANE if hasattr(ADAPTERS[name], "served_boundaries")])
def test_the_observed_capture_follows_the_target_class(impl, wiring, tmp_path, repro):
    """The served list of a class that runs here is read off its forward, not from the ids: a planted runner that
    hands the target every id plus one (worker.py capture, plant "ids_one_deeper") moves what the forward
    captures one boundary deeper, away from the ids the derivation reads."""
    from conformance.adapters.vllm.process import Worker
    from conformance.wiring.cases import CASES_BY_ID, N
    from fixtures.targets import TARGETS, write_target_config

    case = CASES_BY_ID["speculators_explicit"]
    where = {"draft": str(wiring.draft_dir(case, "speculators")),
             "target": str(write_target_config(TARGETS[0], tmp_path) / "config.json"),
             "runner": ADAPTERS[impl].runners[0]}
    worker = Worker.get()
    clean = worker.ask("capture", **where, work=str(worker.scratch()))
    planted = worker.ask("capture", **where, work=str(worker.scratch()), plant="ids_one_deeper")
    assert clean["ran"] and clean["served"] == list(case.boundaries), f"{clean} ({repro})"
    # one deeper; a boundary past the last layer's output (N) is never captured
    assert planted["served"] == [b + 1 for b in case.boundaries if b + 1 <= N], f"{planted} ({repro})"
