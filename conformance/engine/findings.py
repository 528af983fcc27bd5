"""The engine lane's checks of one served scenario, as data: the tests assert on them, the planted-fault
meta tests require them to fail, the report shows them.

- lossless: each output equals the target's greedy continuation;
- acceptance: SGLang's own meta_info (verify count, accepted-draft histogram, accept length) equals the
  reference's simulation of the same request;
- rounds: every round's positions, hand-off (aux states, ids, embeddings), stages, drafted tokens and
  accepted drafts equal the reference's, the first divergence named by request, round, step and stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from conformance.core.compare import Comparison
from conformance.engine.check import compare_tree_round, first_divergent_round
from conformance.engine.lane import EngineLane, GroupRun, Request, ScenarioRun
from conformance.engine.simulate import ReferenceRound
from conformance.engine.twins import accounting
from reference.tree import Attends, ancestors


@dataclass
class RequestFinding:
    request: Request
    greedy: list[int]                       # the target's greedy continuation
    reference: list[ReferenceRound]         # the reference's rounds (chain, or the exact tree)
    conforming_rounds: int                  # rounds before the first divergent one
    divergence: Comparison | None           # the first divergent round's comparison

    @property
    def served_stats(self) -> dict:
        return accounting(self.request.served.meta)

    def reference_stats(self, new_tokens: int) -> dict:
        accepted = [r.accepted for r in self.reference]
        width = max(len(self.served_stats["histogram"]), max(accepted) + 1)
        return {"verify_ct": len(accepted), "histogram": [accepted.count(a) for a in range(width)],
                "accept_length": new_tokens / len(accepted)}

    def lossless_failure(self) -> str | None:
        out = self.request.served.output_ids
        if out == self.greedy:
            return None
        first = next((i for i, (a, b) in enumerate(zip(out, self.greedy)) if a != b), min(len(out), len(self.greedy)))
        return (f"{self.request.label}: output differs from the target's greedy continuation at token {first}: "
                f"served {out[first:first + 4]}, greedy {self.greedy[first:first + 4]}")

    def rounds_failure(self, repro: str) -> str | None:
        """The first divergent round's full message, or a round count that differs (a capture that
        recorded nothing must not pass)."""
        if self.divergence is not None:
            return self.divergence.message(repro)
        if len(self.request.rounds) != len(self.reference):
            return (f"{self.request.label}: the capture holds {len(self.request.rounds)} rounds, the reference "
                    f"{len(self.reference)}; repro: {repro}")
        return None

    def acceptance_failure(self, new_tokens: int) -> str | None:
        served, ref = self.served_stats, self.reference_stats(new_tokens)
        histogram = served["histogram"] + [0] * (len(ref["histogram"]) - len(served["histogram"]))
        if (served["verify_ct"], histogram) == (ref["verify_ct"], ref["histogram"]) and \
                abs(served["accept_length"] - ref["accept_length"]) < 1e-9:
            return None
        return (f"{self.request.label}: SGLang measured verify_ct {served['verify_ct']}, histogram "
                f"{served['histogram']}, accept length {served['accept_length']:.4f}; the reference simulation: "
                f"{ref['verify_ct']}, {ref['histogram']}, {ref['accept_length']:.4f}; accepted per round served "
                f"{[r.accepted for r in self.request.rounds]}, reference {[r.accepted for r in self.reference]}")


def _tree_divergence(served, reference, case_id: str) -> tuple[int, Comparison | None]:
    for r, (s, ref) in enumerate(zip(served, reference)):
        cmp = compare_tree_round(s, ref, f"{case_id}, round {r}")
        if cmp.first_divergence is not None:
            return r, cmp
    return min(len(served), len(reference)), None


def scenario_findings(lane: EngineLane, run: GroupRun, scenario: ScenarioRun,
                      attends: Attends = ancestors) -> list[RequestFinding]:
    """One finding per request; trees against the reference tree with attention rule `attends` (reference/tree.py)."""
    key = ("findings", run.group.id, scenario.scenario.id, attends)
    if key not in lane.memo:
        lane.memo[key] = _findings(lane, run, scenario, attends)
    return lane.memo[key]


def _findings(lane: EngineLane, run: GroupRun, scenario: ScenarioRun, attends: Attends) -> list[RequestFinding]:
    group, new = run.group, scenario.scenario.new_tokens
    out = []
    for i, request in enumerate(scenario.requests):
        case_id = f"{scenario.scenario.id}, request {i} (seq {request.prompt.seq}, {request.prompt.length} tokens)"
        if group.chain:
            reference = lane.chain(request.prompt, group.steps, new)
            r, cmp = first_divergent_round(request.rounds, reference, case_id, claimed=lane.claimed)
        else:
            ndt = run.resolved.get("speculative_num_draft_tokens") or group.draft_tokens
            reference = lane.tree(group, request.prompt, ndt, new, attends)
            r, cmp = _tree_divergence(request.rounds, reference, case_id)
        out.append(RequestFinding(request, lane.greedy(request.prompt, new), reference, r, cmp))
    return out


def lane_failures(lane: EngineLane, run: GroupRun, repro: str) -> list[str]:
    """Every failure of a group's scenarios, in order: the engine, outputs, accounting, then rounds."""
    if run.error:
        return [run.error]
    failures = []
    for scenario in run.scenarios.values():
        for f in scenario_findings(lane, run, scenario):
            failures += [m for m in (f.lossless_failure(), f.acceptance_failure(scenario.scenario.new_tokens),
                                     f.rounds_failure(repro)) if m]
    return failures


def drafter_failure(run: GroupRun) -> str | None:
    """The speculative worker class SGLang's scheduler built (speculative/spec_info.py create_worker; which one depends
    on the flags), named in the report, must be the one whose rounds the capture observed (EAGLEWorkerV2's
    forward_batch_generation, engine_shims.Capture): a worker of another class would serve unobserved."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    module, _, name = run.drafter.rpartition(".")
    if not module.startswith("sglang.srt.speculative"):
        return f"{run.group.id}: drafter {run.drafter!r} is not one of SGLang's speculative workers"
    built = getattr(__import__(module, fromlist=[name]), name)
    observed = any(q.rounds for s in run.scenarios.values() for q in s.requests)
    if issubclass(built, EAGLEWorkerV2) != observed:
        return (f"{run.group.id}: SGLang built {run.drafter}; the capture observed EAGLEWorkerV2 rounds: {observed}")
    return None
