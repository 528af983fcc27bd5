"""A bf16 engine held stage by stage under the bf16 error model (conformance/core/tolerances.py).

The fp32 lane compares a served round with the reference's own simulation of the request. In bf16 that cannot
work bit for bit, nor even round for round: SGLang's bf16 target hands the draft other aux states than the fp32
target, so the fp32 simulation drafts from other inputs. Each served round is therefore compared with the
reference draft fed what SGLang's draft was fed in that round, read from the capture (served.ServedRound):
- step 0: the captured aux states of every row up to the round's last (the rows earlier rounds extended are the
  KV the server's draft attends to), the served context's tokens (prompt and served output) at positions 0..t;
- steps >= 1: the token SGLang drafted at the step before (DraftBatch.next_ids), at positions t + k.
As tolerances.AGAINST says for bf16, the served stage is compared with the fp64 reference on those inputs,
within u|p| + max(k u sqrt(d), m rho) rms_row(p), rho measured by the bf16 reference on the same inputs; drafted
ids are exact except where the fp64 logits cannot order them within that bound (compare._ties). Fed aux states
would compare with themselves, so `aux_in` alone is held to the target instead: the target's aux states on the
served context in fp64, rho from the target in bf16 (the hidden bf16 rule at depth 1: the table has no rule for
a target's stages; rho, the bf16 target's own error at those layers, is what carries their depth).

Lossless in bf16: every served token is the fp64 target's argmax on the served context before it, except where
the fp64 logits cannot order the top two within the bf16 logits bound (rho from the target in bf16; again depth
1, the rho term carrying the target's depth). Where no such tie was excused, the output must also equal the fp32
target's greedy continuation (transformers `generate`, as the fp32 lane) token for token. transformers' own bf16
greedy continuation is no oracle: it rounds differently from SGLang's bf16 kernels and may leave the fp64 argmax
wherever the margin is under the bf16 bound (the batch's request of 9 tokens: at token 10 the fp64 top two are
0.028 apart, the bound 0.365; SGLang's bf16 engine keeps the fp64 argmax, transformers' bf16 takes the other).
Where it leaves the served output, its token there must itself be a bf16 tie of the fp64 logits.

Accounting: SGLang's verify count, accepted-draft histogram and accept length (meta_info) equal what its captured
rounds show, and each round's accepted count is what its own drafted tokens and its output imply (the leading
drafts equal to the tokens it committed next).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from conformance.adapters import ADAPTERS, REFERENCE
from conformance.acceptance.trained_draft import GreedyTarget, one_thread
from conformance.core.compare import Comparison, StageResult, compare_tensors
from conformance.core.tolerances import allowed_error, tol_for
from conformance.engine.check import compare_round
from conformance.engine.lane import EngineLane, GroupRun, Request, ScenarioRun
from conformance.engine.served import ServedRound
from conformance.engine.simulate import ReferenceRound
from conformance.engine.twins import accounting
from reference.eagle3 import DraftBatch

BF16 = torch.bfloat16
IMPL = "sglang engine (bf16)"


@dataclass
class Bf16Finding:
    request: Request
    case_id: str
    greedy_bf16: list[int]                  # transformers generate, bf16 target
    greedy_fp32: list[int]                  # transformers generate, fp32 target
    served_greedy: StageResult              # served tokens against the fp64 target's argmax on the served context
    # transformers' bf16 greedy token where it first leaves the served output, against the same fp64 argmax
    bf16_greedy_at_difference: StageResult | None = None
    ties: int = 0                           # served tokens whose fp64 top two the bf16 bound cannot order
    rounds: list[Comparison] = field(default_factory=list)   # every round that could be built, in order
    structure: list[str] = field(default_factory=list)       # rounds the capture could not be laid on the context

    @property
    def first_divergent(self) -> tuple[int, Comparison] | None:
        return next(((r, c) for r, c in enumerate(self.rounds) if c.first_divergence is not None), None)

    def lossless_failure(self) -> str | None:
        out, g = self.served_greedy, self.request.served.output_ids
        if out.failed:
            return (f"{self.case_id}: served token {out.abs_index[0]} is not the fp64 target's argmax on the served "
                    f"context ({out.mismatched}/{out.numel} tokens; no bf16 tie excuses it): served {g}")
        if "excused" not in out.detail and g != self.greedy_fp32:
            first = next((i for i, (a, b) in enumerate(zip(g, self.greedy_fp32)) if a != b), len(g))
            return (f"{self.case_id}: no bf16 tie excused, yet the output differs from the fp32 target's greedy "
                    f"continuation at token {first}: served {g[first:first + 4]}, fp32 greedy "
                    f"{self.greedy_fp32[first:first + 4]}")
        if self.bf16_greedy_at_difference is not None and self.bf16_greedy_at_difference.failed:
            i = self.bf16_difference
            return (f"{self.case_id}: transformers' bf16 greedy continuation leaves the served output at token {i} "
                    f"({self.greedy_bf16[i]}, served {g[i]}) where the fp64 target orders the two beyond the bf16 "
                    f"logits bound: a difference bf16 rounding does not explain")
        return None

    @property
    def bf16_difference(self) -> int | None:
        """The first token where transformers' bf16 greedy continuation leaves the served output."""
        g = self.request.served.output_ids
        return next((i for i, (a, b) in enumerate(zip(g, self.greedy_bf16)) if a != b), None)

    def lossless_summary(self) -> str:
        """Which greedy continuation the output equals, for the report."""
        g = self.request.served.output_ids
        parts = [f"{self.ties}/{len(g)} tokens at a bf16 tie",
                 f"fp64 argmax on the served context: {'yes' if not self.served_greedy.failed else 'no'}"
                 + (f" ({self.served_greedy.detail})" if self.served_greedy.detail else ""),
                 f"fp32 greedy: {'equal' if g == self.greedy_fp32 else 'differs'}"]
        i = self.bf16_difference
        parts.append("bf16 greedy: equal" if i is None else
                     f"bf16 greedy: differs from token {i} (a bf16 tie of the fp64 logits: "
                     f"{not self.bf16_greedy_at_difference.failed})")
        return "; ".join(parts)

    def rounds_failure(self, repro: str) -> str | None:
        if self.structure:
            return "\n".join(self.structure) + f"\n  repro: {repro}"
        hit = self.first_divergent
        return None if hit is None else hit[1].message(repro)

    def accounting_failure(self, new_tokens: int) -> str | None:
        """SGLang's meta_info against its own captured rounds."""
        served = accounting(self.request.served.meta)
        accepted = [r.accepted for r in self.request.rounds]
        width = max(len(served["histogram"]), max(accepted, default=0) + 1)
        hist = served["histogram"] + [0] * (width - len(served["histogram"]))
        own = {"verify_ct": len(accepted), "histogram": [accepted.count(a) for a in range(width)],
               "accept_length": len(self.request.served.output_ids) / max(len(accepted), 1)}
        if (served["verify_ct"], hist) == (own["verify_ct"], own["histogram"]) and \
                abs((served["accept_length"] or 0) - own["accept_length"]) < 1e-9:
            return None
        return (f"{self.case_id}: SGLang measured verify_ct {served['verify_ct']}, histogram {served['histogram']}, "
                f"accept length {served['accept_length']}; its captured rounds: {own['verify_ct']}, "
                f"{own['histogram']}, {own['accept_length']:.4f} (accepted per round {accepted})")


class Bf16Side:
    """The fp64 and bf16 references of the draft and of the target, loaded once per lane."""

    def __init__(self, lane: EngineLane):
        ckpt = lane.trained.checkpoints["speculators"]
        self.draft = {dtype: ADAPTERS[REFERENCE]().load(ckpt, dtype) for dtype in (torch.float64, BF16)}
        fp32 = lane.target.model
        self.target = {dtype: GreedyTarget(copy.deepcopy(fp32).to(dtype).eval()) for dtype in (torch.float64, BF16)}
        self.aux_ids = lane.trained.config.aux_layer_ids
        self._greedy: dict = {}

    @torch.no_grad()
    def target_run(self, dtype: torch.dtype, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, A*H], logits [T, V]) of the target in `dtype` over `ids`."""
        model = self.target[dtype]
        x = torch.tensor([ids])
        _, aux, _ = model.run(x, self.aux_ids)
        return aux[0], model.model(x).logits[0]

    def greedy_bf16(self, prompt: list[int], new_tokens: int) -> list[int]:
        """transformers' generate on the bf16 target, as lane.greedy on the fp32 one."""
        from transformers import GenerationConfig

        key = (tuple(prompt), new_tokens)
        if key not in self._greedy:
            ids = torch.tensor([prompt])
            config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, bos_token_id=None)
            with torch.no_grad():
                out = self.target[BF16].model.generate(ids, attention_mask=torch.ones_like(ids),
                                                       generation_config=config)
            self._greedy[key] = out[0, ids.shape[1]:].tolist()
        return self._greedy[key]


def side(lane: EngineLane) -> Bf16Side:
    if "bf16 side" not in lane.memo:
        lane.memo["bf16 side"] = Bf16Side(lane)
    return lane.memo["bf16 side"]


def drafted(served: ServedRound) -> list[int]:
    """The target ids SGLang's chain drafted, one per step (what draft() handed to verification)."""
    return served.tree["draft_tokens"].flatten().tolist() if "draft_tokens" in served.tree else []


def implied_accepted(drafts: list[int], output: list[int], committed: int, claimed: int) -> int:
    """The accepted count the round's drafts and the served output imply: the leading drafts equal to the tokens
    committed after the round's context. Past max_new_tokens the output is cut: where every visible draft
    matched, any claim of at least that many is consistent."""
    visible = min(len(drafts), len(output) - committed)
    lead = next((i for i in range(visible) if drafts[i] != output[committed + i]), visible)
    if lead == visible < len(drafts) and claimed >= lead:
        return claimed
    return lead


def greedy_checks(side_: Bf16Side, prompt: list[int], output: list[int],
                  greedy_bf16: list[int]) -> tuple[StageResult, StageResult | None, int]:
    """Each served token against the fp64 target's argmax on the served context before it (target_ids: an id
    stage, exact but for ties the bf16 logits bound cannot order); and transformers' bf16 greedy token where it
    first leaves the served output (the context up to there is the same) held to the same rule: two bf16 greedy
    continuations may part only at a bf16 tie."""
    seq = prompt + output[:-1]
    _, logits64 = side_.target_run(torch.float64, seq)
    _, logits16 = side_.target_run(BF16, seq)
    rows = slice(len(prompt) - 1, len(seq))
    expected, precise, same = logits64[rows].argmax(-1), logits64[rows], logits16[rows]
    room = allowed_error(tol_for("logits", BF16), BF16, precise, precise, same, depth=1)[0]
    served = compare_tensors(0, "target_ids", torch.tensor(output), expected, BF16, expected_logits=precise,
                             logits_allowed=room)
    top = precise.topk(2, dim=-1)
    ties = int((top.values[:, 0] - top.values[:, 1] <= room.gather(-1, top.indices).sum(-1)).sum())
    i = next((i for i, (a, b) in enumerate(zip(output, greedy_bf16)) if a != b), None)
    if i is None:
        return served, None, ties
    at = slice(i, i + 1)
    return served, compare_tensors(0, "target_ids", torch.tensor(greedy_bf16[at]), expected[at], BF16,
                                   expected_logits=precise[at], logits_allowed=room[at]), ties


@one_thread()
def round_comparisons(side_: Bf16Side, request: Request, prompt: list[int], steps: int, case_id: str,
                      rounds: list[ServedRound] | None = None) -> tuple[list[Comparison], list[str]]:
    """Every served round of a chain against the reference fed that round's captured inputs (module docstring).
    `rounds`: the captured rounds to compare (default: the request's; a meta test passes planted ones)."""
    rounds = request.rounds if rounds is None else rounds
    output = request.served.output_ids
    full = prompt + output
    aux64_all, _ = side_.target_run(torch.float64, full)
    aux16_all, _ = side_.target_run(BF16, full)
    out, problems, committed, captured = [], [], 1, []
    for r, served in enumerate(rounds):
        label = f"{case_id}, round {r}"
        captured += [p.rows.get("aux_in") for p in served.extend]
        context = torch.tensor(full[:len(prompt) + committed])
        T = len(context) - 1
        if any(a is None for a in captured) or sum(a.shape[0] for a in captured) != T:
            problems.append(f"{IMPL} [{label}]: the capture's step-0 rows ("
                            f"{sum(a.shape[0] for a in captured if a is not None)}, aux_in of each) do not cover the "
                            f"served context's {T} rows")
            break
        drafts = drafted(served)
        if len(drafts) != steps:
            problems.append(f"{IMPL} [{label}]: {len(drafts)} drafted tokens captured, {steps} draft steps")
            break
        aux = torch.cat(captured)
        traces = {}
        for dtype, model in side_.draft.items():
            batch = DraftBatch(aux=aux.to(dtype), input_ids=context[1:], positions=torch.arange(T),
                               seq_ids=torch.zeros(T, dtype=torch.long),
                               # Only row t is compared at steps >= 1, and under the TTT mask row t at step k
                               # sees its own ids of steps 1..k alone: every row may be fed the served drafts.
                               next_ids=torch.tensor(drafts[:steps - 1]).expand(T, steps - 1) if steps > 1 else None)
            traces[dtype] = model.run(batch, steps)
        # aux_in, fed to the reference above, is held to the target instead (module docstring).
        traces[torch.float64].steps[0]["aux_in"] = aux64_all[:T]
        traces[BF16].steps[0]["aux_in"] = aux16_all[:T]
        accepted = implied_accepted(drafts, output, committed, served.accepted)
        ref = ReferenceRound(context, traces[torch.float64], torch.tensor(drafts), accepted)
        out.append(compare_round(served, ref, label, impl=IMPL, dtype=BF16, same=traces[BF16]))
        committed += served.accepted + 1
    return out, problems


def bf16_findings(lane: EngineLane, run: GroupRun, scenario: ScenarioRun) -> list[Bf16Finding]:
    key = ("bf16 findings", run.group.id, scenario.scenario.id)
    if key not in lane.memo:
        s = side(lane)
        found = []
        for i, request in enumerate(scenario.requests):
            case_id = (f"{scenario.scenario.id}, request {i} (seq {request.prompt.seq}, "
                       f"{request.prompt.length} tokens)")
            prompt, output = lane.prompt_ids(request.prompt), request.served.output_ids
            new = scenario.scenario.new_tokens
            bf16_greedy = s.greedy_bf16(prompt, new)
            finding = Bf16Finding(request, case_id, bf16_greedy, lane.greedy(request.prompt, new),
                                  *greedy_checks(s, prompt, output, bf16_greedy))
            finding.rounds, finding.structure = round_comparisons(s, request, prompt, run.group.steps, case_id)
            found.append(finding)
        lane.memo[key] = found
    return lane.memo[key]
