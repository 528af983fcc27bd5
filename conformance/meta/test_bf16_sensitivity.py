"""bf16 against fp64: the error model's multiple k holds for the reference itself, and what the bound catches.

Calibration: on every built-in case, the bf16 reference at step 0 is within the floor alone (rho = 0:
u|p| + k u sqrt(d) rms_row(p)) of the fp64 reference with a margin of at least MARGIN on k
(conformance/core/tolerances.py states the measured ratio); the MLA cases within k itself (see MLA_CASES).
Steps >= 1 inherit the recurrent hidden's error, which rho carries.

Sensitivity: faults planted in the bf16 reference's trace, one stage of one step at a time, compared as an
implementation is (against fp64, rho from the unplanted bf16 reference): the stage scaled by 1.005, 1.01,
1.02, 1.05, and its rows shifted by one position (row t holds row t-1's values). A shift is caught at every
stage it changes, and 5% at the inputs and fc of step 0; the scalings are caught where they exceed what bf16
rounding leaves there, and the table (printed; run with -s) says where, for docs/tolerances.md.
"""
from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from conformance.core import stages as S
from conformance.core.compare import OK, compare_tensors
from conformance.core.tolerances import allowed_error, row_rms, tol_for, unit_roundoff
from fixtures.cases import MULTISTEP_CASES, STEP0_CASES

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

BF16 = torch.bfloat16
MARGIN = 1.5
CASES = [(case, 1) for case in STEP0_CASES] + [(case, 7) for case in MULTISTEP_CASES]
SCALINGS = (0.005, 0.01, 0.02, 0.05)
GROUPS = {   # stage base name -> row of the table
    "aux_in": "aux_in, embeds (inputs)", "embeds": "aux_in, embeds (inputs)",
    "fc_in_norm": "fc_in_norm, fc_out", "fc_out": "fc_in_norm, fc_out",
    "hidden_in": "norms and residual", "embeds_norm": "norms and residual", "hidden_norm": "norms and residual",
    "residual": "norms and residual", "attn_in": "norms and residual",
    **{b: "q, k, v (+ norms, RoPE)" for b in ("q_latent", "q", "k", "v", "kv_latent", "q_norm", "k_norm", "k_rope",
                                            "q_rot", "k_rot")},
    "attn_core": "attn_core, attn_out, post_attn", "attn_out": "attn_core, attn_out, post_attn",
    "post_attn": "attn_core, attn_out, post_attn",
    "post_attn_norm": "post_attn_norm, mlp_out, layer_out", "mlp_out": "post_attn_norm, mlp_out, layer_out",
    "layer_out": "post_attn_norm, mlp_out, layer_out",
    "final_norm": "final_norm, recurrent_hidden", "recurrent_hidden": "final_norm, recurrent_hidden",
    "logits": "logits", "input_ids": "ids", "draft_ids": "ids", "target_ids": "ids",
}


def walk(trace):
    """(step, stage, depth) of a trace in forward order; depth counts the step's float stages so far."""
    for step in range(len(trace.steps)):
        depth = 0
        for stage in S.stage_names(trace.num_layers):
            if stage in trace.steps[step]:
                depth += S.stage_kind(stage) != "ids"
                yield step, stage, depth


def traces(drafts, case, steps):
    return drafts.trace("reference", case, BF16, steps), drafts.trace("reference", case, torch.float64, steps)


def worst_ratio(drafts, cases) -> tuple[float, str]:
    """The largest (|ref - p| - u|p|) / (u sqrt(d) rms_row(p)) of the bf16 reference at step 0 over `cases`."""
    u, worst = unit_roundoff(BF16), (0.0, "")
    for case, steps in cases:
        ref, precise = traces(drafts, case, steps)
        for step, stage, depth in walk(precise):
            if step > 0 or S.stage_kind(stage) == "ids":
                continue
            x, p = ref.steps[0][stage].double(), precise.steps[0][stage].double()
            ratio = float((((x - p).abs() - u * p.abs()) / (u * math.sqrt(depth) * row_rms(p))).max())
            worst = max(worst, (ratio, f"{case.id} {stage}"))
    return worst


# The MLA draft family (fixtures/cases.py MLA) is measured apart: its values pass two bf16 projections through a
# normed latent (kv_a_proj -> kv_a_layernorm -> kv_b_proj) and attention averages their correlated rounding while it
# shrinks the row's rms; ms_mla_q_lora's attn_core reaches 6.98 (row 17; 1.7 at its v), within k = 8 but a margin
# of 1.15, not MARGIN. k is the tolerance table's (conformance/core/tolerances.py): whether the MLA family needs
# its margin is that table's review, not this test's.
LLAMA_LAYERS = [(c, s) for c, s in CASES if c.config.draft_arch != "mla"]
MLA_CASES = [(c, s) for c, s in CASES if c.config.draft_arch == "mla"]


def test_floor_covers_the_bf16_reference_at_step_0(drafts):
    worst = worst_ratio(drafts, LLAMA_LAYERS)
    k = tol_for("hidden", BF16).k
    print(f"\nbf16 reference at step 0: the largest (|ref - p| - u|p|) / (u sqrt(d) rms_row(p)) is {worst[0]:.2f} "
          f"({worst[1]}); k = {k:g}, a margin of {k / worst[0]:.2f}")
    assert worst[0] * MARGIN <= k, f"the bf16 reference reaches {worst[0]:.2f} u sqrt(d) rms_row at {worst[1]}: " \
                                   f"k = {k:g} leaves it less than a margin of {MARGIN}"


def test_floor_covers_the_bf16_mla_reference_without_margin(drafts):
    """The MLA family's bf16 reference stays within the floor itself (its margin: the note above)."""
    worst, k = worst_ratio(drafts, MLA_CASES), tol_for("hidden", BF16).k
    assert worst[0] <= k, f"the bf16 reference reaches {worst[0]:.2f} u sqrt(d) rms_row at {worst[1]}: above k = {k:g}"


def planted_verdicts(drafts):
    """{(row, step group): {fault: [caught, planted]}} over every stage of every built-in case."""
    table = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for case, steps in CASES:
        ref, precise = traces(drafts, case, steps)
        room = {}
        for step, stage, depth in walk(precise):
            x, p = ref.steps[step][stage], precise.steps[step][stage]
            kind = S.stage_kind(stage)
            if stage == "logits":
                room[step] = allowed_error(tol_for(kind, BF16), BF16, p, p, x, depth)[0]
            logits = precise.steps[step]["logits"] if kind == "ids" else None
            # compared as an implementation is: against fp64, rho from the unplanted bf16 reference
            args = dict(expected=p, dtype=BF16, expected_logits=logits, precise=p, same=x, depth=depth,
                        logits_allowed=room.get(step))
            assert compare_tensors(step, stage, x, **args).verdict == OK, \
                f"{case.id} step {step} {stage}: the unplanted bf16 reference is out"
            cell = table[(GROUPS[stage.rsplit(".", 1)[-1]], "0" if step == 0 else "1-6")]
            planted = {f: x.double() * (1 + f) for f in (SCALINGS if kind != "ids" else ())}
            shifted = torch.roll(x, 1, 0)
            if not torch.equal(shifted, x):   # a stage whose rows are all alike has no position to lose
                planted["shift"] = shifted
            for fault, actual in planted.items():
                cell[fault][0] += compare_tensors(step, stage, actual, **args).verdict != OK
                cell[fault][1] += 1
    return table


def test_planted_faults_in_bf16(drafts):
    table = planted_verdicts(drafts)
    faults = (*SCALINGS, "shift")
    head = ["stages", "steps", *(f"x{1 + f:g}" for f in SCALINGS), "rows shifted by one"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (group, steps), cell in sorted(table.items(), key=lambda kv: (kv[0][1], list(GROUPS.values()).index(kv[0][0]))):
        lines.append(f"| {group} | {steps} | " + " | ".join(
            "-" if cell[f][1] == 0 else f"{cell[f][0]}/{cell[f][1]}" for f in faults) + " |")
    print("\nplanted in the bf16 reference, compared against fp64 (caught / planted):\n" + "\n".join(lines))
    missed = {g: c["shift"] for g, c in table.items() if c["shift"][0] < c["shift"][1]}
    assert not missed, f"a row shift went unseen: {missed}"
    # Before the first matmul and norm (one or two roundings), 5% is well outside bf16's rounding.
    first = {g: c[0.05] for g, c in table.items() if g[1] == "0" and g[0] in (GROUPS["aux_in"], GROUPS["fc_out"])}
    assert all(caught == planted for caught, planted in first.values()), f"x1.05 missed at step 0: {first}"
