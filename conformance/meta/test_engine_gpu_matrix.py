"""The CUDA engine lane (conformance/engine/test_engine_gpu.py) up to the CUDA call, on CPU: its configuration
matrix against SGLang's own ServerArgs, its kernel gate, and its checks on recorded rounds with planted differences.

The recorded rounds are written by the engine lane's own capture (engine_shims.Capture, the class that runs inside
SGLang's scheduler) in the events a CUDA engine writes (`tree`: what draft() handed to verify; `round`: what verify
accepted), read back by the lane's reader (served.served_rounds), with the drafted tokens and accepted counts of
the reference's simulation of the chain_k3 `batch` requests: a conforming run. The planted runs are the same
events with one drafted token, one accepted count or one histogram bin changed.
"""
from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from conformance import plugin
from conformance.adapters.sglang import engine_cuda
from conformance.adapters.sglang.engine import RESOLVED_FIELDS, Served, read_events
from conformance.adapters.sglang.engine_shims import Capture
from conformance.engine.gpu_lane import (
    ASKED, CHAIN_GROUPS, eager_twin_failures, gpu_findings, reference_failures, served_as_asked,
)
from conformance.engine.gpu_matrix import BACKENDS, BY_ID, MATRIX, PAGE_SIZES, GpuConfig, server_args_problems
from conformance.engine.lane import EngineLane, Request, ScenarioRun
from conformance.engine.scenarios import SCENARIOS
from conformance.engine.served import served_rounds

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

READABLE_ID = re.compile(r"(triton|fa3|flashinfer)-(graph|eager)-(overlap|sync)-page(1|16)")
CONFIG = BY_ID["fa3-graph-overlap-page16"]      # the configuration the planted runs are recorded as


# ---------------------------------------------------------------- the matrix

def test_matrix_is_every_combination_once_with_readable_ids():
    combos = {(c.backend, c.cuda_graph, c.overlap, c.page_size) for c in MATRIX}
    expected = {(b, g, o, p) for b in BACKENDS for g in (False, True) for o in (False, True) for p in PAGE_SIZES}
    assert combos == expected and len(MATRIX) == len(expected) == 24, sorted(expected - combos)
    ids = [c.id for c in MATRIX]
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]
    assert all(READABLE_ID.fullmatch(i) for i in ids), [i for i in ids if not READABLE_ID.fullmatch(i)]
    # an id says the whole configuration: two configurations differing in one axis differ in their ids
    for a in MATRIX:
        for field in ("cuda_graph", "overlap"):
            assert dataclasses.replace(a, **{field: not getattr(a, field)}).id != a.id, (a.id, field)


@pytest.mark.parametrize("config", MATRIX, ids=lambda c: c.id)
def test_configuration_is_valid_server_args(config):
    """SGLang 0.5.23's ServerArgs holds every keyword the engine gets (its fields, their types, its attention
    backend choices for target and draft), and every one the configuration sets is one SGLang reports resolved."""
    args = {**engine_cuda.BASE_ARGS, **config.server_args()}
    assert not server_args_problems(args), server_args_problems(args)
    assert set(config.server_args()) == set(ASKED) and set(ASKED) <= set(RESOLVED_FIELDS), config.server_args()


@pytest.mark.parametrize("planted,named", [
    ({"disable_cuda_graphs": True}, "`disable_cuda_graphs` is not a ServerArgs field"),
    ({"page_size": "16"}, "ServerArgs refuses `page_size='16'`"),
    ({"disable_overlap_schedule": 1}, "ServerArgs refuses `disable_overlap_schedule=1`"),
    ({"attention_backend": "fa33"}, "attention_backend `fa33` is not one of SGLang's attention backends"),
    ({"attention_backend": "torch_native"}, "attention_backend `torch_native` is not one of SGLang's draft attention"),
], ids=["field", "type", "bool", "backend", "draft-backend"])
def test_server_args_check_names_a_planted_mistake(planted, named):
    args = {**MATRIX[0].server_args(), **planted}
    problems = server_args_problems(args)
    assert problems and problems[0].startswith(named), problems


def test_eager_twins():
    twins = {c.eager_twin for c in MATRIX}
    assert twins == {c for c in MATRIX if c.is_eager_twin} and len(twins) == len(BACKENDS), sorted(t.id for t in twins)
    for c in MATRIX:
        t = c.eager_twin
        assert (t.backend, t.dtype, t.cuda_graph, t.overlap, t.page_size) == (c.backend, c.dtype, False, False, 1), c.id


def test_fa3_gate_follows_sglangs():
    """SGLang's FA3 backend on a non-MLA model needs SM 8.x or 9.x (attention_registry.py:241-247)."""
    fa3, triton = BY_ID["fa3-eager-sync-page1"], BY_ID["triton-eager-sync-page1"]
    assert fa3.unavailable((9, 0)) is None and fa3.unavailable((8, 6)) is None
    assert "compute capability 8.x or 9.x" in fa3.unavailable((10, 0)) and triton.unavailable((10, 0)) is None


def test_served_as_asked_names_an_override():
    resolved = dict(CONFIG.server_args())
    assert served_as_asked(CONFIG, resolved) == []
    resolved["disable_overlap_schedule"] = True
    assert served_as_asked(CONFIG, resolved) == [
        f"{CONFIG.id}: asked disable_overlap_schedule=False, SGLang serves True"]


# ---------------------------------------------------------------- the kernel gate

class Item:
    def __init__(self):
        self.markers = []

    def add_marker(self, mark):
        self.markers.append(mark)


def options(require_gpu: bool):
    return types.SimpleNamespace(getoption=lambda name: require_gpu if name == "--require-gpu" else None)


def test_kernel_gate_skips_with_one_line_and_refuses_under_require_gpu(monkeypatch):
    """On a CUDA host the engine gpu tests need SGLang's CUDA kernels: planted absent (an import name no package
    has), each test skips with the one line naming it; --require-gpu refuses the run with it; present, nothing."""
    monkeypatch.setattr(engine_cuda, "KERNELS", {"conformance_absent_kernel": "absent-kernel-package"})
    items = [Item(), Item()]
    plugin.cuda_kernels(options(False), items)
    reasons = [m.kwargs["reason"] for item in items for m in item.markers]
    assert reasons == [engine_cuda.missing()] * 2 and "\n" not in reasons[0], reasons
    assert "conformance_absent_kernel from absent-kernel-package" in reasons[0], reasons[0]
    with pytest.raises(pytest.UsageError, match="--require-gpu: 2 engine gpu tests selected but engine gpu: SGLang's"):
        plugin.cuda_kernels(options(True), [Item(), Item()])
    monkeypatch.setattr(engine_cuda, "KERNELS", {"torch": "torch"})
    present = Item()
    plugin.cuda_kernels(options(True), [present])
    assert present.markers == []


# ---------------------------------------------------------------- recorded rounds

GROUP, SCENARIO = SCENARIOS["batch"]


def record(directory, rids: list[str], rounds: list[list[tuple[list[int], int]]]) -> dict:
    """The events a CUDA engine's capture writes for a batch served together, round by round (a request that
    finished drops out of the batch), read back as the lane reads them."""
    capture = Capture(directory)
    for r in range(max(len(x) for x in rounds)):
        live = [i for i, x in enumerate(rounds) if r < len(x)]
        capture.call, capture.rids = r, [rids[i] for i in live]
        capture.write("tree", {"draft_tokens": torch.tensor([rounds[i][r][0] for i in live]),
                               "parent_list": torch.zeros(len(live), 1, dtype=torch.long),
                               "top_scores_index": torch.zeros(len(live), 1, dtype=torch.long)}, topk=1)
        capture.write("round", {"accept_lens": torch.tensor([rounds[i][r][1] + 1 for i in live]),
                                "next_token_ids": torch.zeros(len(live), dtype=torch.long)}, mode="DECODE")
    return served_rounds(read_events(directory), GROUP.topk)


def sglang_meta(rid: str, accepted: list[int], new_tokens: int, width: int) -> dict:
    """SGLang's meta_info for a request of these rounds: verify count, accepted-draft histogram, and accept length
    as completion tokens / verify count (tokenizer_manager.py:3148-3172)."""
    return {"id": rid, "spec_verify_ct": len(accepted), "spec_accept_length": new_tokens / len(accepted),
            "spec_correct_drafts_histogram": [accepted.count(a) for a in range(width)]}


@pytest.fixture(scope="module")
def recorded(trained_draft, tmp_path_factory):
    """(lane, eager run, make(name, plant)): the reference side, the conforming run recorded as the eager twin, and
    a maker of further recorded runs with a plant applied to their rounds (request -> [(drafted, accepted)])."""
    lane = EngineLane(trained_draft, tmp_path_factory.mktemp("gpu-recorded"))
    prompts = SCENARIO.prompts
    new = SCENARIO.new_tokens
    references = [lane.chain(p, GROUP.steps, new) for p in prompts]
    conforming = [[(r.drafts.tolist(), r.accepted) for r in ref] for ref in references]
    rids = [f"rid{i}" for i in range(len(prompts))]

    def make(name: str, plant=lambda rounds, metas: None) -> ScenarioRun:
        rounds = [list(x) for x in conforming]
        metas = [sglang_meta(rid, [a for _, a in x], new, GROUP.steps + 1) for rid, x in zip(rids, rounds)]
        plant(rounds, metas)
        served = record(tmp_path_factory.mktemp(name), rids, rounds)
        requests = [Request(p, Served(lane.prompt_ids(p), lane.greedy(p, new), meta), served[rid])
                    for p, rid, meta in zip(prompts, rids, metas)]
        return ScenarioRun(SCENARIO, requests, 0.0)
    return lane, make("eager", ), make


def test_recorded_rounds_are_the_lanes(recorded):
    """The recorded run is what the lane reads: every request's rounds, each with K drafted tokens."""
    lane, eager, _ = recorded
    assert GROUP in CHAIN_GROUPS
    for request in eager.requests:
        reference = lane.chain(request.prompt, GROUP.steps, SCENARIO.new_tokens)
        assert len(request.rounds) == len(reference) > 1, request.label
        assert all(r.tree["draft_tokens"].shape == (GROUP.steps,) for r in request.rounds), request.label


def test_unplanted_runs_pass(recorded):
    lane, eager, make = recorded
    graph = make("graph")
    assert eager_twin_failures(CONFIG, graph, eager) == []
    assert reference_failures(CONFIG, graph, gpu_findings(lane, GROUP, graph)) == []


def plant_token(rounds, metas):
    drafted, accepted = rounds[1][2]
    rounds[1][2] = ([drafted[0], (drafted[1] + 1) % 97, *drafted[2:]], accepted)


def test_planted_drafted_token_is_named_by_configuration_request_and_round(recorded):
    """One drafted token changed in round 2 of request 1 of the 'graph' run: caught against the eager twin and
    against the reference simulation, named by configuration, scenario, request and round."""
    lane, eager, make = recorded
    graph = make("graph-token", plant_token)
    request = graph.requests[1]
    case = f"{CONFIG.eager_twin.id}"
    failures = eager_twin_failures(CONFIG, graph, eager)
    assert len(failures) == 1, failures
    assert failures[0].startswith(f"{CONFIG.id} vs {case}: batch, request 1 ({request.label}), round 2: "
                                  f"{CONFIG.id} drafted "), failures
    found = reference_failures(CONFIG, graph, gpu_findings(lane, GROUP, graph))
    assert len(found) == 1 and found[0].startswith(f"{CONFIG.id}: batch, request 1 ({request.label}), round 2: "
                                                   f"SGLang {CONFIG.id} drafted "), found


def plant_accepted(rounds, metas):
    drafted, accepted = rounds[0][1]
    rounds[0][1] = (drafted, (accepted + 1) % (GROUP.steps + 1))


def test_planted_accepted_count_is_named(recorded):
    lane, eager, make = recorded
    graph = make("graph-accepted", plant_accepted)
    failures = eager_twin_failures(CONFIG, graph, eager)
    assert len(failures) == 1 and f"batch, request 0 ({graph.requests[0].label}), round 1: " in failures[0], failures


def plant_histogram(rounds, metas):
    histogram = metas[2]["spec_correct_drafts_histogram"]
    top = max(a for a in range(1, len(histogram)) if histogram[a])
    histogram[top] -= 1
    histogram[top - 1] += 1


def test_planted_histogram_difference_is_named(recorded):
    """One request's accepted-draft histogram with one round moved to the bin below (what SGLang reported, its
    rounds unchanged): caught against the eager twin and against the reference simulation."""
    lane, eager, make = recorded
    graph = make("graph-histogram", plant_histogram)
    request = graph.requests[2]
    failures = eager_twin_failures(CONFIG, graph, eager)
    assert failures == [f"{CONFIG.id} vs {CONFIG.eager_twin.id}: batch, request 2 ({request.label}): accepted-draft "
                        f"histogram {CONFIG.id} {request.served.meta['spec_correct_drafts_histogram']}, "
                        f"{CONFIG.eager_twin.id} {eager.requests[2].served.meta['spec_correct_drafts_histogram']}"], \
        failures
    found = reference_failures(CONFIG, graph, gpu_findings(lane, GROUP, graph))
    assert len(found) == 1 and found[0].startswith(f"{CONFIG.id}: batch, request 2: {request.label}: SGLang "
                                                   "measured verify_ct"), found


def test_a_config_of_another_backend_is_not_its_twin():
    """Each configuration is held to its own backend's eager run (another backend computes in another dtype)."""
    assert all(c.eager_twin.backend == c.backend for c in MATRIX)
    assert GpuConfig("fa3", True, True, 16).eager_twin == BY_ID["fa3-eager-sync-page1"]
