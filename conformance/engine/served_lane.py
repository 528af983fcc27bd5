"""The engine lane of a server in an environment of its own (an adapter whose `engine` runs out of process, e.g.
`make vllm-engine`): its serving engine serves the trained tiny draft (head_dim 32, in one and two layers) for
its tiny Llama target, greedy, fp32, and each request is checked as the in-process engine lane checks SGLang's:

- lossless: the output equals the target's greedy continuation (transformers `generate`);
- the server's own spec-decode counters equal the reference's simulation exactly: per request, its accepted
  drafts per verify step and drafts per step; per scenario, its aggregate counters (drafts, draft tokens,
  accepted tokens, accepted per position);
- every round stage by stage (conformance/engine/check.py): positions, the hand-off, every draft stage, the
  drafted and accepted tokens, observed inside the engine; the first divergence names request, round, step, stage.

The reference side (greedy continuations, the simulation) is the in-process lane's (lane.EngineLane), on the same
trained draft. Scenario groups are data (GROUPS), each served by one engine, shut down before the next.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from conformance.acceptance.trained_draft import Recipe, TrainedDraft, trained_draft
from conformance.core.areas import ROW_SIGNATURES, ServedDivergence
from conformance.core.compare import Comparison
from conformance.engine.check import first_divergent_round
from conformance.engine.lane import EngineLane
from conformance.engine.scenarios import Prompt, Scenario
from conformance.engine.simulate import ReferenceRound

# The trained tiny draft with head_dim 32 (vLLM's CPU attention kernel takes head sizes >= 32), by draft layers.
RECIPES = {1: Recipe(head_dim=32), 2: Recipe(head_dim=32, draft_layers=2)}


@dataclass(frozen=True)
class ServedGroup:
    id: str
    K: int                                  # num_speculative_tokens: a chain of K drafts per round
    scenarios: tuple[Scenario, ...]
    layers: int = 1                         # the trained draft's decoder layers (RECIPES)
    checkpoint_format: str = "speculators"  # the draft directory served (the trained draft is written in both)
    long_prefill_token_threshold: int | None = None   # prefill chunks of at most this many tokens per step
    fault: str | None = None                # a planted fault of the engine's (meta tests only)
    env: dict = field(default_factory=dict)


def _two(first: int) -> tuple[tuple[Prompt, ...], ...]:
    return ((Prompt(first, 2), Prompt(first + 1, 4)),)


GROUPS = (
    ServedGroup("chain_k1", 1, (Scenario("chain_k1", "chain of 1 draft per round", _two(0)),)),
    ServedGroup("chain_k2_chunked", 2, (Scenario(
        "chunked_prefill", "prefill chunks of at most 4 tokens (long_prefill_token_threshold): prompts of 11 and 6 "
        "tokens split mid-way", ((Prompt(2, 11), Prompt(3, 6)),), new_tokens=12),), long_prefill_token_threshold=4),
    ServedGroup("chain_k3", 3, (
        Scenario("batch", "three requests of 2, 5 and 9 tokens in one batch",
                 ((Prompt(4, 2), Prompt(5, 5), Prompt(6, 9)),)),
        # Prefix-cache hits come in whole KV blocks (32 tokens here), and with EAGLE vLLM drops the last matched
        # block (v1/core/single_type_kv_cache_manager.py:819): a prompt of 65 tokens (two full blocks) is needed
        # for a hit of one block.
        Scenario("prefix_hit", "a cold request of 65 tokens, then the same prompt again (a prefix-cache hit: two "
                 "full 32-token blocks match, EAGLE drops the last) and a prompt of 66 tokens that extends it",
                 ((Prompt(7, 65),), (Prompt(7, 65), Prompt(7, 66)))),
    )),
    ServedGroup("chain_k4", 4, (Scenario("chain_k4", "chain of 4 drafts per round", _two(8)),)),
    ServedGroup("chain_k5", 5, (Scenario("chain_k5", "chain of 5 drafts per round", _two(10)),)),
    ServedGroup("two_layers", 3, (Scenario("two_layers", "the trained 2-layer draft, chain of 3", _two(12)),),
                layers=2),
    ServedGroup("sglang_format", 3, (Scenario("sglang_format", "the trained draft in SGLang's format (ids in "
                                              "eagle_config), chain of 3", _two(14)),), checkpoint_format="sglang"),
)


@dataclass
class Request:
    prompt: Prompt
    served: object                # the engine's Served (output_ids, meta)
    rounds: list                  # its ServedRounds

    @property
    def label(self) -> str:
        return f"request seq {self.prompt.seq}, prompt {self.prompt.length} tokens"


@dataclass
class ScenarioRun:
    scenario: Scenario
    requests: list[Request]
    counters: dict                # the server's aggregate spec-decode counters over the scenario's waves
    seconds: float


@dataclass
class GroupRun:
    group: ServedGroup
    resolved: dict = field(default_factory=dict)
    planted: str | None = None
    start_seconds: float = 0.0
    scenarios: dict[str, ScenarioRun] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Finding:
    request: Request
    greedy: list[int]
    reference: list[ReferenceRound]
    conforming_rounds: int
    divergence: Comparison | None
    K: int

    def lossless_failure(self) -> str | None:
        out = self.request.served.output_ids
        if out == self.greedy:
            return None
        first = next((i for i, (a, b) in enumerate(zip(out, self.greedy)) if a != b), min(len(out), len(self.greedy)))
        return (f"{self.request.label}: output differs from the target's greedy continuation at token {first}: "
                f"served {out[first:first + 4]}, greedy {self.greedy[first:first + 4]}")

    @property
    def reference_accepted(self) -> list[int]:
        return [r.accepted for r in self.reference]

    def counters_failure(self) -> str | None:
        """The server's per-request counters (accepted drafts and drafts per verify step, in order) against the
        simulation's rounds."""
        m = self.request.served.meta.get("spec_decode") or {}
        served = (m.get("per_step_accepted", []), m.get("per_step_drafted", []))
        ref = (self.reference_accepted, [self.K] * len(self.reference))
        if served == ref:
            return None
        return (f"{self.request.label}: the server counted accepted per verify step {served[0]}, drafts per step "
                f"{served[1]}; the reference simulation {ref[0]}, {ref[1]}; the capture's accepted per round "
                f"{[r.accepted for r in self.request.rounds]}")

    def observed(self) -> ServedDivergence:
        """The first divergence as the registry's engine area reads it: its place and the rows that differ."""
        first = None if self.divergence is None else self.divergence.first_divergence
        if first is None:
            return ServedDivergence(None)
        place = (self.conforming_rounds, first.step, first.stage)
        return ServedDivergence(place, row_signature(self) if place == (0, 0, "input_ids") else "other")

    def rounds_failure(self, repro: str) -> str | None:
        if self.divergence is not None:
            return self.divergence.message(repro)
        if len(self.request.rounds) != len(self.reference):
            return (f"{self.request.label}: the capture holds {len(self.request.rounds)} rounds, the reference "
                    f"{len(self.reference)}; repro: {repro}")
        return None


CHUNK_ENDS = ROW_SIGNATURES[0]


def chunk_end_rows(f: Finding) -> tuple[list[int], list[int]]:
    """(the rows of round 0's step 0 whose served ids differ from the reference's, the last rows of its partial
    prefill chunks where the prompt's last token is another token than the next one)."""
    prompt = f.request.served.prompt
    extend = f.request.rounds[0].extend if f.request.rounds else []
    served_ids = [int(t) for p in extend for t in p.rows["input_ids"]]
    expected = prompt[1:len(served_ids)] + [f.greedy[0]]
    wrong = [t for t, (a, b) in enumerate(zip(served_ids, expected)) if a != b]
    if any(served_ids[t] != prompt[-1] for t in wrong):
        return wrong, []   # a row served another token than the prompt's last: not the chunk ends' signature
    ends = [sum(p.width for p in extend[:i + 1]) - 1 for i in range(len(extend) - 1)]
    return wrong, [t for t in ends if prompt[-1] != prompt[t + 1]]


def row_signature(f: Finding) -> str:
    """CHUNK_ENDS when the rows of round 0's step 0 that differ are exactly the last rows of its partial prefill
    chunks, each served the prompt's last token; else "other"."""
    wrong, ends = chunk_end_rows(f)
    return CHUNK_ENDS if wrong and wrong == ends else "other"


def expected_counters(findings: list[Finding], K: int) -> dict:
    """The aggregate spec-decode counters the simulation's rounds give (the engine module names the server's own
    counter behind each key: COUNTERS)."""
    accepted = [a for f in findings for a in f.reference_accepted]
    return {"drafts": len(accepted), "draft tokens": K * len(accepted), "accepted tokens": sum(accepted),
            "accepted per position": [sum(a > i for a in accepted) for i in range(K)]}


class ServedLane:
    """Each group served once per session by `engine` (an adapter's engine module), its references once."""

    def __init__(self, engine: ModuleType, root: Path):
        self.engine, self.root = engine, root
        self.trained: dict[int, TrainedDraft] = {}
        self.lanes: dict[int, EngineLane] = {}
        self._runs: dict[str, GroupRun] = {}
        self._findings: dict = {}
        self.recorded: set = set()

    def reference(self, layers: int) -> EngineLane:
        """The in-process lane's reference side on the trained draft of `layers` layers (no engine of its own)."""
        if layers not in self.lanes:
            self.trained[layers] = trained_draft(RECIPES[layers])
            self.lanes[layers] = EngineLane(self.trained[layers], self.root / f"reference-{layers}")
        return self.lanes[layers]

    def run(self, group: ServedGroup) -> GroupRun:
        if group.id not in self._runs:
            self._runs[group.id] = self._serve(group)
        return self._runs[group.id]

    def _serve(self, group: ServedGroup) -> GroupRun:
        lane, run = self.reference(group.layers), GroupRun(group)
        trained = self.trained[group.layers]
        capture = self.root / group.id
        try:
            engine = self.engine.ServedEngine(trained.target_dir, trained.checkpoints[group.checkpoint_format], capture,
                                              group.K, group.long_prefill_token_threshold, fault=group.fault,
                                              env=group.env)
        except self.engine.EngineFailed as exc:
            run.error = f"engine {group.id} did not start: {exc}"
            return run
        outputs = []
        try:
            run.start_seconds, run.resolved, run.planted = engine.start_seconds, engine.resolved(), engine.planted
            for scenario in group.scenarios:
                start, served, first_wave = time.perf_counter(), [], len(engine.counters)
                for wave in scenario.waves:
                    served += zip(wave, engine.generate([lane.prompt_ids(p) for p in wave], scenario.new_tokens))
                counters = _summed(engine.counters[first_wave:])
                outputs.append((scenario, served, counters, time.perf_counter() - start))
        except self.engine.EngineFailed as exc:
            run.error = f"engine {group.id} failed while serving: {exc}"
        finally:
            engine.shutdown()
        rounds = self.engine.served_rounds(self.engine.read_events(capture))
        for scenario, served, counters, seconds in outputs:
            per_request = self.engine.by_request(rounds, [s for _, s in served])
            requests = [Request(p, s, r) for (p, s), r in zip(served, per_request)]
            run.scenarios[scenario.id] = ScenarioRun(scenario, requests, counters, seconds)
        return run

    def findings(self, run: GroupRun, scenario: ScenarioRun) -> list[Finding]:
        key = (run.group.id, scenario.scenario.id)
        if key not in self._findings:
            lane, new, out = self.reference(run.group.layers), scenario.scenario.new_tokens, []
            for i, request in enumerate(scenario.requests):
                case_id = (f"{scenario.scenario.id}, request {i} (seq {request.prompt.seq}, {request.prompt.length} "
                           "tokens)")
                reference = lane.chain(request.prompt, run.group.K, new)
                r, cmp = first_divergent_round(request.rounds, reference, case_id, impl=f"{self.engine.NAME} engine")
                out.append(Finding(request, lane.greedy(request.prompt, new), reference, r, cmp, run.group.K))
            self._findings[key] = out
        return self._findings[key]

    def counters_failure(self, run: GroupRun, scenario: ScenarioRun) -> str | None:
        expected = expected_counters(self.findings(run, scenario), run.group.K)
        if scenario.counters == expected:
            return None
        return (f"{scenario.scenario.id}: the server's spec-decode counters over the scenario {scenario.counters}; "
                f"the reference simulation's rounds give {expected}")

    def failures(self, run: GroupRun, repro: str) -> list[str]:
        """Every failure of a group, in order: the engine, outputs, counters, then rounds."""
        if run.error:
            return [run.error]
        out = []
        for scenario in run.scenarios.values():
            for f in self.findings(run, scenario):
                out += [m for m in (f.lossless_failure(), f.counters_failure(), f.rounds_failure(repro)) if m]
            if m := self.counters_failure(run, scenario):
                out.append(m)
        return out


def _summed(counters: list[dict]) -> dict:
    out: dict = {}
    for c in counters:
        for k, v in c.items():
            out[k] = [a + b for a, b in zip(out[k], v)] if isinstance(v, list) and k in out else \
                (out.get(k, 0) + v if not isinstance(v, list) else list(v))
    return out
