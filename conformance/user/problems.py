"""What a user check found, as verdict Problems: the registry's reason and the fix when an entry names
it, the implementation's own words and file:line when none does.

FIXES holds the fix per registry entry (the config key or server flag to change, or that SGLang cannot
serve the knob), keyed by entry id, until the registry carries a `fix` field itself; the templates
take the draft's knobs by name.
"""
from __future__ import annotations

import re

from conformance.adapters import ADAPTERS
from conformance.core import matching, registry
from conformance.core.compare import MISSING, Comparison
from conformance.core.tolerances import dtype_name
from conformance.core.findings import FORWARD, LOADING, Problem
from conformance.core.sections import FAIL, KNOWN, PASS
from reference.eagle3 import Eagle3Config

RETRAIN = "SGLang cannot serve this knob; retrain without it"
FIXES = {
    "sglang-fc-skipped-when-widths-coincide":
        f"{RETRAIN}: SGLang skips fc whenever num_aux_hidden_states * target_hidden_size == hidden_size "
        "({num_aux_hidden_states} * {target_hidden_size} == {hidden_size}); retrain with another hidden_size",
    "sglang-fc-input-norm-skipped-when-widths-coincide":
        f"{RETRAIN}: SGLang skips fc and its norms whenever num_aux_hidden_states * target_hidden_size == "
        "hidden_size ({num_aux_hidden_states} * {target_hidden_size} == {hidden_size}); "
        "retrain with another hidden_size",
    "sglang-residual-never-normed":
        f"{RETRAIN}: norm_before_residual false (speculators trains with true unless given "
        "--no-norm-before-residual: train/config/schema.py:145)",
    "sglang-qkv-bias-dropped": f"{RETRAIN}: attention_bias false",
    "sglang-qkv-bias-dropped-at-load": f"{RETRAIN}: attention_bias false",
    "sglang-mlp-bias-dropped": f"{RETRAIN}: mlp_bias false",
    "sglang-mlp-bias-dropped-at-load": f"{RETRAIN}: mlp_bias false",
    "sglang-config-window-ignored":
        f"{RETRAIN}: sliding_window unset (the server flag --speculative-draft-window-size {{window_flag}} "
        "matches training at draft step 0 only: the window then slides with the chain)",
    "sglang-window-flag-is-exclusive":
        f"--speculative-draft-window-size {{window_flag}}, not {{sliding_window}} (SGLang's window holds W + 1 keys); "
        f"later draft steps still differ, so to be served as trained: {RETRAIN} (sliding_window unset)",
    "sglang-window-slides-with-the-chain": f"{RETRAIN}: sliding_window unset",
    "sglang-hidden-norm-on-later-layers": f"{RETRAIN}: num_hidden_layers 1",
    "sglang-hidden-norm-of-later-layers-never-loaded": f"{RETRAIN}: num_hidden_layers 1",
    "speculators-fc-ignores-target-hidden-size":
        "speculators 0.9.0 cannot load a draft with target_hidden_size {target_hidden_size} != hidden_size "
        "{hidden_size}; it cannot have trained this draft as written (state the trainer with --trainer)",
    "speculators-never-ties-lm-head":
        "tie_word_embeddings false, with lm_head.weight stored (a copy of embed_tokens.weight): "
        "speculators 0.9.0 never ties",
    "specforge-requires-vocab-mapping":
        "store the identity vocabulary map SpecForge builds for a full vocabulary: d2t (int64 zeros, "
        "{draft_vocab_size}) and t2d (bool ones, {vocab_size})",
    "sglang-tree-kv-follows-row-slots":
        "draft a chain: --speculative-eagle-topk 1 --speculative-num-steps S --speculative-num-draft-tokens S+1 "
        "(SGLang's chain draft is served as trained)",
    "sglang-sink-size-ignored": "drop --speculative-draft-sink-size (the draft attends without sink tokens)",
    "sglang-lm-head-from-target-without-draft-vocab":
        "write \"draft_vocab_size\": {vocab_size} into config.json: SGLang then serves the draft's own lm_head",
    "sglang-mla-fc-skipped-when-widths-coincide":
        f"{RETRAIN}: SGLang's MLA draft skips fc whenever num_aux_hidden_states * target_hidden_size == hidden_size "
        "({num_aux_hidden_states} * {target_hidden_size} == {hidden_size}); retrain with another hidden_size",
    "sglang-mla-fc-norm-skipped-when-widths-coincide":
        f"{RETRAIN}: SGLang's MLA draft skips fc and fc_norm whenever num_aux_hidden_states * target_hidden_size "
        "== hidden_size ({num_aux_hidden_states} * {target_hidden_size} == {hidden_size}); retrain with another "
        "hidden_size",
    "sglang-mla-input-norm-dropped-at-load":
        f"{RETRAIN}: norm_before_fc false (SGLang's MLA draft has no input norm over the aux states)",
    "sglang-mla-input-norm-skipped":
        f"{RETRAIN}: norm_before_fc false (SGLang's MLA draft has no input norm over the aux states)",
    "sglang-mla-requires-q-lora": f"{RETRAIN}: with a q_lora_rank (q_a_proj, q_a_layernorm, q_b_proj)",
    "specforge-yarn-without-beta-and-mscale":
        "write the yarn defaults into rope_scaling: beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 0",
}
UNKNOWN_FIX = "none known: not a registered divergence; report it with report.json"

def fix_for(entry: registry.Known, cfg: Eagle3Config) -> str:
    text = getattr(entry, "fix", None) or FIXES.get(entry.id)
    if not text:
        return UNKNOWN_FIX
    window = cfg.sliding_window
    return text.format(**vars(cfg), window_flag=window - 1 if window else "W-1")


def _version(impl: str) -> str:
    return f"{impl} {registry.installed_version(impl) or ''}".strip()


def report_outcome(problem: Problem | None) -> str:
    """A comparison's outcome in the report: a registered cause is a known divergence there, as the verdict
    names it (still a problem of the verdict: the draft is not served as trained)."""
    return PASS if problem is None else KNOWN if problem.known else FAIL


def forward_problem(impl: str, cfg: Eagle3Config, known, comparison: Comparison, steps: int) -> Problem | None:
    """The first divergence of one comparison (None when it conforms)."""
    first = comparison.first_divergence
    if first is None:
        return None
    run = f"{dtype_name(comparison.dtype)}/{steps}-step"
    if first.verdict == MISSING:
        evidence = f"{impl} did not produce stage `{first.stage}` ({run}). {first.detail}".strip()
    elif first.max_abs is None:
        evidence = f"{first.detail} ({run})"
    else:
        evidence = (f"max abs error {first.max_abs:.3e} at {first.abs_index}, max rel {first.max_rel:.3e}; "
                    f"{first.mismatched}/{first.numel} elements out of tolerance "
                    f"(atol {first.tol.atol:g}, rtol {first.tol.rtol:g}; {run})")
    entry = matching.match_forward(known, first, cfg.num_hidden_layers)
    where = f"draft step {first.step}, stage `{first.stage}`"
    what = f"{_version(impl)} departs from training semantics at {where}"
    if entry is None:
        return Problem(what, where, evidence, "not a registered divergence: the stage named is where it starts",
                       UNKNOWN_FIX, FORWARD, key=f"{impl}:forward:{first.step}:{first.stage}", impl=impl, seen=run)
    return Problem(f"{what} ({entry.id})", where, evidence, entry.reason, fix_for(entry, cfg), FORWARD,
                   key=entry.id, known=entry.id, impl=impl, seen=run)


def load_problem(impl: str, cfg: Eagle3Config, known, message: str) -> Problem:
    """The implementation's loader refused the draft (message: one line, the loader's own words)."""
    m = re.search(r"(\w+(?:Error|Exception)): (.*)$", message)
    error, text = (m.group(1), m.group(2)) if m else (None, message)
    entry = matching.match_load(known, error, text)
    what = f"{_version(impl)} cannot load this draft"
    if entry is None:
        return Problem(what, "load", message, "the loader's own error, quoted as evidence", UNKNOWN_FIX, LOADING,
                       key=f"{impl}:load", impl=impl)
    return Problem(f"{what} ({entry.id})", "load", message, entry.reason, fix_for(entry, cfg), LOADING,
                   key=entry.id, known=entry.id, impl=impl)


def accounting_problems(impl: str, cfg: Eagle3Config, known, acct) -> list[Problem]:
    """One problem per registry entry that explains some of the accounting, one for the rest."""
    found = matching.accounting_problems(acct)
    if not found:
        return []
    landed = f"{len(acct.landed)}/{acct.tensors} tensors landed"
    refused = [what for problem, what in found if problem == "refused"]
    if refused:
        return [load_problem(impl, cfg, known, refused[0])]
    used, unexplained = matching.match_accounting(known, found)
    out = []
    for entry in used:
        tensors = [what for problem, what in found if problem == entry.problem
                   and any(re.fullmatch(t, what) for t in entry.tensors)]
        out.append(Problem(f"{_version(impl)} does not load the checkpoint as written ({entry.id})",
                           f"{entry.problem}: {', '.join(tensors)}", landed, entry.reason, fix_for(entry, cfg),
                           LOADING, key=entry.id, known=entry.id, impl=impl))
    if unexplained:
        dropped = [u.split(": ", 1)[1] for u in unexplained if u.startswith("dropped silently")]
        cause = (ADAPTERS[impl].silent_drop or "the loader's own behaviour") if dropped else \
            "not a registered divergence: the accounting names the parameters"
        fix = (f"{RETRAIN} ({', '.join(dropped)}); or delete the tensor if training did not use it" if dropped
               else UNKNOWN_FIX)
        out.append(Problem(f"{_version(impl)} does not load the checkpoint as written", _by_layer(unexplained),
                           landed, cause, fix, LOADING, key=f"{impl}:accounting", impl=impl))
    return out


_LAYER_PARAM = re.compile(r"(?P<kind>[^:]+): (?P<prefix>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<rest>.+)")


def _by_layer(findings: list[str]) -> str:
    """The accounting's findings, one line: layers whose parameters share a finding alike (a model built deeper
    than the file: layers 1..N-1 never loaded) as one span of layers with their parameters, the rest by name."""
    spans: dict[tuple[str, str], dict[int, list[str]]] = {}
    for finding in findings:
        if m := _LAYER_PARAM.fullmatch(finding):
            spans.setdefault((m["kind"], m["prefix"]), {}).setdefault(int(m["layer"]), []).append(m["rest"])
    out, shown = [], set()
    for finding in findings:
        m = _LAYER_PARAM.fullmatch(finding)
        layers = spans.get((m["kind"], m["prefix"]), {}) if m else {}
        whole = [i for i, rest in layers.items() if sorted(rest) == sorted(layers[min(layers)])]
        if not m or len(whole) < 2 or int(m["layer"]) not in whole:
            out.append(finding)
        elif (m["kind"], m["prefix"]) not in shown:
            shown.add((m["kind"], m["prefix"]))
            count = sum(len(layers[i]) for i in whole)
            span = f"{min(whole)}-{max(whole)}" if len(whole) == max(whole) - min(whole) + 1 else \
                ",".join(map(str, sorted(whole)))
            names = ", ".join(sorted(layers[min(whole)]))
            out.append(f"{m['kind']}: {m['prefix']}{span}.{{{names}}} ({count} parameters)")
    return "; ".join(out)
