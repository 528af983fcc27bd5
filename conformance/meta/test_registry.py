"""Self-tests of the registry of known behaviour (conformance/core/registry.toml).

Every entry must decide a case and show, on every case it decides and in every dtype, exactly the place
and signature it registers (so removing it turns those cases into failures that name it). Planted
entries show that a wrong, too broad or out-of-range entry hides nothing; a malformed file is one line.
Settings entries are about serving behaviour a CPU run cannot observe (beyond SGLang's own resolution):
each must flag a command line or draft of the suite, and `shown_by` names the comparison that shows it; one
that neither SGLang's resolution nor a comparison shows is labelled `asserted = true` ("asserted, not
observed" in the support matrix and the verdict).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

import conformance.core.registry as registry
from conformance.adapters import ADAPTERS
from conformance.session.harness import LoadFailed, assert_conforms, compare_with_reference, conformance_params
from conformance.core.areas import ServedDivergence, deciding
from conformance.core.matching import (
    KnownDivergenceHit, accounting_problems, judge, match_load, match_wiring, settle_accounting,
)
from conformance.core.registry import REGISTRY, Known, RegistryError, for_accounting, for_case, load_registry
from conformance.session.report import Report
from conformance.core.tolerances import DTYPES
from fixtures.cases import ALL_CASES, CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def entries(*areas: str) -> list[Known]:
    """The entries of `areas` whose range holds for the installed release: one of another release only shows
    there (the version matrix runs that release, conformance/versions; its cases are strict xfails there)."""
    return [e for e in REGISTRY if e.area in areas and e.version_holds()]


def entries_of_area(area: str) -> list[Known]:
    """Every entry of `area`, whatever its range: how an entry matches does not depend on what is installed."""
    return [e for e in REGISTRY if e.area == area]


def by_id(entry: Known) -> str:
    return entry.id


# ---------------------------------------------------------------- draft forward and load failures

def runnable_cases(impl: str) -> list:
    from conformance.adapters import cannot_express

    return [case for case in ALL_CASES if cannot_express(impl, case.config) is None]


def decided_cases(entry: Known, reg) -> list:
    """The cases `entry` decides: a load entry wherever it applies, a draft entry where it is the earliest; among
    the cases its implementation can run (the others are skipped, never run: cannot_express)."""
    out = []
    for case in runnable_cases(entry.impl):
        known = for_case(entry.impl, case, registry=reg)
        if entry in known and (entry.area == "load" or deciding(known, case.config.num_hidden_layers) == entry):
            out.append(case)
    return out


def draft_problems(entry: Known, drafts, reg=None) -> list[str]:
    """What is wrong with a draft or load entry: it decides no case, or a case in some dtype shows another
    first divergence (or none), or another refusal than its exception class and message pattern."""
    cases = decided_cases(entry, reg)
    if not cases:
        return [f"{entry.id}: decides no case (its xfail would never run)"]
    problems = []
    for case in cases:
        for dtype_name in sorted(DTYPES):
            try:
                steps = (entry.step or 0) + 1
                first = compare_with_reference(drafts, entry.impl, case, dtype_name, steps=steps).first_divergence
                seen = "no divergence" if first is None else f"step {first.step} `{first.stage}`"
                ok = entry.area == "draft" and first is not None and (first.step, first.stage) == (entry.step,
                                                                                                 entry.stage)
            except LoadFailed as exc:
                seen = f"load refused: {exc.error}: {exc.detail}"
                ok = entry.area == "load" and match_load([entry], exc.error, exc.detail) is not None
            if not ok:
                problems.append(f"{entry.id}: case {case.id} in {dtype_name} shows {seen}, not {entry.place}")
    return problems


@pytest.mark.parametrize("entry", entries("draft", "load"), ids=by_id)
def test_draft_and_load_entries_show_exactly_what_they_register(entry, drafts):
    problems = draft_problems(entry, drafts)
    assert not problems, "stale registry entry:\n  " + "\n  ".join(problems)


BOGUS = [
    Known("draft", "bogus-no-case", "sglang", ">=0", "hidden_size == 12345", "nothing", step=0, stage="fc_out"),
    Known("draft", "bogus-wrong-stage", "sglang", ">=0", "norm_output", "norm_output conforms", step=0, stage="fc_out"),
    Known("draft", "bogus-other-version", "sglang", "<0.1", "norm_before_residual", "x", step=0,
          stage="layers.0.residual"),
    Known("load", "bogus-wrong-message", "speculators", ">=0", "tie_word_embeddings", "x", error="ValueError",
          message="size mismatch loading"),
    Known("load", "bogus-wrong-class", "speculators", ">=0", "tie_word_embeddings", "x", error="TypeError",
          message="lm_head"),
]


@pytest.mark.parametrize("entry", BOGUS, ids=by_id)
def test_a_bogus_entry_is_caught(entry, drafts):
    problems = draft_problems(entry, drafts, reg=(entry,))
    assert problems and problems[0].startswith(entry.id), f"bogus entry not caught: {entry}"


@pytest.mark.parametrize("change", [{"message": "size mismatch loading"}, {"error": "TypeError"}],
                         ids=["other_message", "other_class"])
def test_a_load_entry_with_another_signature_does_not_hide_the_refusal(change, drafts, monkeypatch, repro):
    """speculators' tied-embedding refusal: the registered entry makes it the known hit; the same entry with
    another message pattern or exception class leaves it an ordinary failure, with the loader's words."""
    case, real = CASES_BY_ID["tied_embeddings"], next(e for e in REGISTRY if e.id == "speculators-never-ties-lm-head")
    with pytest.raises(KnownDivergenceHit):
        assert_conforms(drafts, Report(), "speculators", case, "fp32", "planted", repro)
    monkeypatch.setattr(registry, "REGISTRY", (dataclasses.replace(real, **change),))
    with pytest.raises(AssertionError) as info:
        assert_conforms(drafts, Report(), "speculators", case, "fp32", "planted", repro)
    assert not isinstance(info.value, KnownDivergenceHit) and "lm_head" in str(info.value), str(info.value)


def test_an_entry_outside_the_installed_version_makes_an_ordinary_test(drafts, monkeypatch, repro):
    """The first SGLang draft entry with its version range moved off the installed version: its case has
    no xfail mark and, since SGLang still diverges, fails as an ordinary test naming the stage."""
    entry = next(e for e in entries("draft") if e.impl == "sglang" and e.step == 0)
    case = decided_cases(entry, None)[0]
    assert all(p.marks for p in conformance_params(["sglang"], ["fp32"], [case])), "no xfail to begin with"
    moved = tuple(dataclasses.replace(e, versions="<0.1") if e is entry else e for e in REGISTRY)
    monkeypatch.setattr(registry, "REGISTRY", moved)
    assert not any(p.marks for p in conformance_params(["sglang"], ["fp32"], [case]))
    with pytest.raises(AssertionError) as info:
        assert_conforms(drafts, Report(), "sglang", case, "fp32", "planted", repro)
    assert not isinstance(info.value, KnownDivergenceHit) and entry.stage in str(info.value), str(info.value)


def test_an_uninstalled_implementation_has_no_known_behaviour(monkeypatch):
    """A host without SGLang (e.g. a GPU box running only speculators) must collect, and SGLang's
    tests there must fail on the import rather than pass as expected failures."""
    entry = entries("draft")[0]
    case = decided_cases(entry, None)[0]
    monkeypatch.setattr(ADAPTERS[entry.impl], "package", f"{entry.impl}-not-installed-here", raising=False)
    registry.installed_version.cache_clear()
    try:
        assert registry.installed_version(entry.impl) is None
        assert not for_case(entry.impl, case), f"{entry.id} still applies to {case.id} without {entry.impl}"
    finally:
        monkeypatch.undo()
        registry.installed_version.cache_clear()
    assert for_case(entry.impl, case)


# ---------------------------------------------------------------- tree drafting

@pytest.mark.parametrize("entry", entries("tree"), ids=by_id)
def test_tree_entries_show_exactly_what_they_register(entry, drafts):
    from conformance.draft.test_tree import DTYPE, compare_tree, make_reference_tree
    from conformance.draft.tree_cases import TREE_CASES, known_tree

    cases = [c for c in TREE_CASES if deciding(known_tree(c), CASES_BY_ID[c.draft].config.num_hidden_layers) == entry]
    assert cases, f"{entry.id}: decides no tree case"
    for case in cases:   # the tree lane is fp32 only
        draft = CASES_BY_ID[case.draft]
        tree = ADAPTERS[entry.impl]().load(drafts.checkpoint(draft)["sglang"], DTYPE).run_tree(
            drafts.batch(draft, 1), case.steps, case.topk, case.num_draft_tokens)
        first = compare_tree(tree, make_reference_tree(drafts, case), case).first_divergence
        assert first is not None and (first.step, first.stage) == (entry.step, entry.stage), (
            f"{entry.id}: tree case {case.id} first diverges at "
            f"{'nothing' if first is None else (first.step, first.stage)}, not {entry.place}")


# ---------------------------------------------------------------- target wiring

def wiring_cases():
    from conformance.wiring.cases import wiring_matrix
    from fixtures.targets import CAPTURE_ONLY_TARGETS, TARGETS

    return wiring_matrix(TARGETS + CAPTURE_ONLY_TARGETS)


@pytest.mark.parametrize("entry", entries("wiring"), ids=by_id)
def test_wiring_entries_show_exactly_what_they_register(entry, wiring, tmp_path):
    from conformance.core.registry import applicable
    from conformance.wiring.cases import runners, wiring_names
    from conformance.wiring.test_serving_sides import served_comparison

    cases = [(*x, runner) for x in wiring_cases() for runner in runners(entry.impl)
             if applicable("wiring", entry.impl, wiring_names(*x, runner))[:1] == (entry,)]
    assert cases, f"{entry.id}: decides no wiring case"
    for target, case, fmt, runner in cases:
        if ADAPTERS[entry.impl].served_boundaries is not None:   # another server, read by its own code
            comparison, _ = served_comparison(entry.impl, target, case, fmt, wiring, tmp_path, runner)
        elif target.no_forward:
            comparison = wiring.capture_ids_only(target, case, fmt)
        else:
            comparison, _ = wiring.serve(target, case, fmt)
        assert match_wiring((entry,), comparison.observed) is entry, (
            f"{entry.id}: {comparison.case_id} shows {comparison.kind}"
            + (f" ({comparison.error_class}: {comparison.error})" if comparison.error else "") + f", not {entry.place}")


def test_a_wiring_entry_does_not_hide_another_kind_of_mismatch(wiring, repro):
    """SGLang serves input-of-layer ids one layer deeper on Llama (registered); the same capture with its
    last chunk cut off is a missing slot, which that entry must not make a known hit."""
    from conformance.wiring.test_wiring import assert_wiring
    from conformance.wiring.cases import CASES_BY_ID as WIRING_CASES, DEEPER, MISSING, known_wiring
    from conformance.wiring.comparison import compare_capture
    from fixtures.targets import TARGETS_BY_ID

    target, case, fmt = TARGETS_BY_ID["llama"], WIRING_CASES["speculators_explicit"], "sglang_input_ids"
    known = known_wiring(target, case, fmt)
    comparison, aux = wiring.serve(target, case, fmt)
    assert comparison.kind == DEEPER and match_wiring(known, comparison.observed) is known[0]
    with pytest.raises(KnownDivergenceHit):
        assert_wiring(comparison, known, Report(), repro)
    states = wiring.target(target).states
    cut = compare_capture(comparison.case_id, case.boundaries, states, aux[:, :-states[0].shape[-1]], comparison.read,
                          comparison.layers_to_capture)
    assert cut.kind == MISSING
    with pytest.raises(AssertionError) as info:
        assert_wiring(cut, known, Report(), repro)
    assert not isinstance(info.value, KnownDivergenceHit), str(info.value)


def test_an_error_wiring_entry_matches_only_its_exception(wiring, repro):
    """SGLang refuses a speculators-format config (registered: its ValueError and message). Planted: the same
    entry with another exception class, or another message, and the same refusal observed with another class
    or message, are not that entry: each fails as unexplained, never as the known hit."""
    from conformance.wiring.cases import CASES_BY_ID as WIRING_CASES, REFUSED, known_wiring
    from conformance.wiring.test_wiring import assert_wiring
    from fixtures.targets import TARGETS_BY_ID

    target, case, fmt = TARGETS_BY_ID["llama"], WIRING_CASES["speculators_explicit"], "speculators"
    known = known_wiring(target, case, fmt)
    comparison, _ = wiring.serve(target, case, fmt)
    assert comparison.kind == REFUSED and known[0].error and match_wiring(known, comparison.observed) is known[0]
    with pytest.raises(KnownDivergenceHit):
        assert_wiring(comparison, known, Report(), repro)
    other_class = dataclasses.replace(known[0], error="KeyError")
    other_message = dataclasses.replace(known[0], message="Should have a `tokenizer_class` key")
    raised_otherwise = dataclasses.replace(comparison, error_class="TypeError")
    said_otherwise = dataclasses.replace(comparison, error=comparison.error.replace("model_type", "architectures"))
    for against, seen in (((other_class,), comparison), ((other_message,), comparison), (known, raised_otherwise),
                           (known, said_otherwise)):
        assert seen.kind == REFUSED and match_wiring(against, seen.observed) is None, (against[0].place, seen.error)
        with pytest.raises(AssertionError) as info:
            assert_wiring(seen, against, Report(), repro)
        assert not isinstance(info.value, KnownDivergenceHit), str(info.value)


# ---------------------------------------------------------------- weight accounting

@pytest.mark.parametrize("entry", entries("accounting"), ids=by_id)
def test_accounting_entries_still_name_their_tensors(entry, drafts):
    """Every case the entry applies to, in every dtype: each of its tensor patterns names a tensor with
    its problem."""
    from conformance.adapters import account

    cases = [c for c in ALL_CASES if entry in for_accounting(entry.impl, c)]
    assert cases, f"{entry.id}: applies to no case"
    problems = []
    for case in cases:
        for dtype_name, dtype in sorted(DTYPES.items()):
            acct = account(entry.impl, drafts.directory(entry.impl, case), dtype)
            named = [t for p, t in accounting_problems(acct) if p == entry.problem]
            problems += [f"{entry.id}: case {case.id} in {dtype_name}: no {entry.problem} tensor matches {pattern!r} "
                         f"({named or 'none'})" for pattern in entry.tensors if not any(re.fullmatch(pattern, t)
                                                                                          for t in named)]
    assert not problems, "stale registry entry:\n  " + "\n  ".join(problems)


def test_an_accounting_entry_does_not_hide_another_dropped_tensor(drafts, tmp_path, repro):
    """SGLang drops the q/k/v biases (registered); a planted unknown tensor it drops too must fail."""
    from conformance.adapters import account
    from fixtures.checkpoint import edited_copy

    case = CASES_BY_ID["attention_bias"]
    known, ckpt = for_accounting("sglang", case), drafts.checkpoint(case)["sglang"]
    with pytest.raises(KnownDivergenceHit):
        settle_accounting(account("sglang", ckpt), known, "sglang weight accounting [attention_bias]", repro)

    def edit(w):
        w["layers.0.self_attn.q_norm.weight"] = torch.ones(case.config.head_dim)
    planted = account("sglang", edited_copy(ckpt, tmp_path / "sglang", edit))
    with pytest.raises(AssertionError) as info:
        settle_accounting(planted, known, "sglang weight accounting [attention_bias, planted]", repro)
    message = str(info.value)
    assert not isinstance(info.value, KnownDivergenceHit) and "q_norm.weight" in message.split("registry:")[-1], message


# ---------------------------------------------------------------- server settings

@pytest.fixture(scope="module")
def settings_probes(trained_draft) -> dict[str, list]:
    """findings per probe: the trained draft under every command line of the settings tests, that draft's
    config without draft_vocab_size, and the suite's draft cases served with their own flags."""
    from conformance.adapters.sglang.settings import DEFAULT_SGLANG_ARGS, draft_facts, effective_settings, findings
    from conformance.settings.test_sglang_settings import CHAIN, MORE_STEPS_THAN_TRAINED, SEED_ARGS, SILENT

    t = trained_draft
    facts = draft_facts(t.checkpoints["speculators"], t.checkpoints["sglang"], t.target_dir, t.config)
    lines = [DEFAULT_SGLANG_ARGS, SEED_ARGS, MORE_STEPS_THAN_TRAINED, CHAIN, *(line for _, line, _ in SILENT)]
    probes = {line: effective_settings(line, t.target_dir, t.checkpoints["sglang"], facts) for line in lines}
    out = {line: s.findings for line, s in probes.items()}
    chain = probes[CHAIN]
    bare = dataclasses.replace(facts, sglang_config={k: v for k, v in facts.sglang_config.items()
                                                     if k != "draft_vocab_size"})
    out["config without draft_vocab_size"] = findings(chain.requested, chain.effective, [], bare, "LlamaForCausalLM")
    for case in ALL_CASES:
        effective = {**chain.effective, **dict(case.sglang_args)}
        out[f"draft case {case.id}"] = findings(chain.requested, effective, [], dataclasses.replace(
            facts, config=case.config), "LlamaForCausalLM")
    return out


@pytest.mark.parametrize("entry", entries("settings"), ids=by_id)
def test_settings_entries_flag_a_probe(entry, settings_probes):
    """Each entry flags a probe, and says how the suite knows it: observed by SGLang's own resolution (a setting
    it resolves: the finding needs the resolution to change it), shown by a comparison (shown_by), or else
    labelled `asserted = true` (its condition alone flags it; the support matrix and the verdict say so)."""
    from conformance.adapters.sglang.settings import NUMBERS

    fired = [probe for probe, found in settings_probes.items() if any(f.entry == entry.id for f in found)]
    assert fired, f"{entry.id}: flags no command line or draft of the suite"
    if entry.shown_by is not None:
        shown = next(e for e in REGISTRY if e.id == entry.shown_by)
        assert shown.area in ("draft", "tree", "load") and shown.impl == entry.impl, (
            f"{entry.id}: shown_by {shown.id} is not a comparison of {entry.impl}")
    observed = entry.setting in NUMBERS or entry.shown_by is not None
    assert entry.asserted != observed, (
        f"{entry.id}: " + ("observed, yet labelled asserted" if observed else
                           "neither resolved by SGLang nor shown by a comparison: label it `asserted = true`"))


# ---------------------------------------------------------------- readings of one file

# Files as users write them (the example draft in a format, top-level config keys rewritten; None: removed; or
# prepared for a server by its trainer's own helper), each read by every implementation as the verdict gives it the
# file (conformance/user/store.py).
READING_PROBES = {"tie_pruned_own_head": ("sglang", {"tie_word_embeddings": True}),
                  "absent_norm_before_residual": ("speculators", {"norm_before_residual": None}),
                  "nemo_served_by_serve_sglang": ("nemo", {}, "sglang")}


@pytest.fixture(scope="module")
def reading_stores(tmp_path_factory) -> dict:
    import json

    from conformance.user.example_draft import write_example
    from conformance.user.store import UserDraftStore
    from conformance.user.user_draft import validate_inputs

    root, out = tmp_path_factory.mktemp("readings"), {}
    for name, (fmt, keys, *prepared) in READING_PROBES.items():
        draft, _, _ = write_example(root / name, fmt, prepared_for=prepared[0] if prepared else None)
        config = json.loads((draft / "config.json").read_text())
        for key, value in keys.items():
            config.pop(key) if value is None else config.__setitem__(key, value)
        (draft / "config.json").write_text(json.dumps(config))
        out[name] = UserDraftStore(root / name / "store", validate_inputs(draft))
    return out


def reading_problems(entry: Known, stores: dict) -> list[str]:
    """What is wrong with a reading entry: it applies to no probe file, or on one its implementation's loaded
    model reads the key otherwise than the entry says."""
    from conformance.core.areas import Reading
    from conformance.core.matching import judge
    from conformance.user.readings import names, observe

    applied = {name: store for name, store in stores.items()
               if entry in registry.applicable("reading", entry.impl, names(store.inputs.checkpoint), (entry,))}
    if not applied:
        return [f"{entry.id}: applies to no probe file"]
    problems = []
    for name, store in applied.items():
        seen = observe(store.account_of(entry.impl), entry.key)
        if not judge("reading", [entry], Reading(entry.key, seen)).hits:
            problems.append(f"{entry.id}: {entry.impl} reads {entry.key} of {name} as {seen!r}, not {entry.reads!r}")
    return problems


@pytest.mark.parametrize("entry", [e for e in entries("reading") if not (e.stage or e.error)], ids=by_id)
def test_reading_entries_are_what_the_loaded_models_read(entry, reading_stores):
    """Observed on the model each implementation loaded from the file as the verdict gives it (the entries with a
    place, of a format the suite writes, are its comparisons' strict xfails: draft/test_served_formats.py)."""
    problems = reading_problems(entry, reading_stores)
    assert not problems, "stale registry entry:\n  " + "\n  ".join(problems)


BOGUS_READINGS = [
    Known("reading", "bogus-sglang-reads-the-stored-head", "sglang", ">=0", "'tie_word_embeddings' in overruled",
          "x", key="tie_word_embeddings", reads="lm_head.weight"),
    Known("reading", "bogus-speculators-defaults-true", "speculators", ">=0",
          "format == 'speculators' and 'norm_before_residual' in absent", "x", key="norm_before_residual",
          reads="true"),
    Known("reading", "bogus-no-probe", "sglang", ">=0", "hidden_size == 12345", "x", key="tie_word_embeddings",
          reads="embed_tokens"),
    Known("reading", "bogus-sglang-builds-the-stored-layers", "sglang", ">=0", "format == 'nemo-sglang'", "x",
          key="num_hidden_layers", reads="the layers stored"),
]


@pytest.mark.parametrize("entry", BOGUS_READINGS, ids=by_id)
def test_a_bogus_reading_entry_is_caught(entry, reading_stores):
    problems = reading_problems(entry, reading_stores)
    assert problems and problems[0].startswith(entry.id), f"bogus entry not caught: {entry}"


# ---------------------------------------------------------------- the file and the support matrix page

ENTRY = 'id="x"\nimpl="sglang"\nversions="==0.5.23"\nreason="r"\n'


@pytest.mark.parametrize("text,field", [
    ('[[known]]\narea="draft"\n' + ENTRY + 'when="no_such_knob"\nstep=0\nstage="fc_out"\n', "no_such_knob"),
    ('[[known]]\narea="draft"\n' + ENTRY + 'when="__import__(1)"\nstep=0\nstage="fc_out"\n', "Call"),
    ('[[known]]\narea="draft"\n' + ENTRY.replace('"sglang"', '"nosuch"') + 'when="mlp_bias"\nstep=0\nstage="fc_out"\n',
     "impl"),
    ('[[known]]\narea="draft"\n' + ENTRY + 'when="mlp_bias"\nstep=0\nstage="fc"\n', "stage"),
    ('[[known]]\narea="draft"\nid="x"\nimpl="sglang"\nreason="r"\nwhen="mlp_bias"\nstep=0\nstage="fc_out"\n',
     "versions"),
    ('[[known]]\narea="draft"\n' + ENTRY.replace("==0.5.23", "not a range") + 'when="mlp_bias"\nstep=0\n'
     'stage="fc_out"\n', "entry #1"),
    ('[[known]]\narea="forward"\n' + ENTRY + 'when="mlp_bias"\n', "area"),
    ('[[known]]\narea="load"\n' + ENTRY + 'when="mlp_bias"\nerror="ValueError"\nmessage="(unclosed"\n', "message"),
    ('[[known]]\narea="wiring"\n' + ENTRY + 'when="format == 1"\nkind="sideways"\n', "kind"),
    ('[[known]]\narea="wiring"\n' + ENTRY + 'when="mlp_bias"\nkind="slot missing"\n', "mlp_bias"),
    ('[[known]]\narea="wiring"\n' + ENTRY + 'when="format == 1"\nkind="capture failed"\n', "error"),
    ('[[known]]\narea="wiring"\n' + ENTRY + 'when="format == 1"\nkind="slot missing"\nerror="TypeError"\n'
     'message="x"\n', "error"),
    ('[[known]]\narea="accounting"\n' + ENTRY + 'when="mlp_bias"\nproblem="lost"\ntensors=["x"]\n', "problem"),
    ('[[known]]\narea="accounting"\n' + ENTRY + 'when="mlp_bias"\nproblem="never loaded"\ntensors=[]\n', "tensors"),
    ('[[known]]\narea="settings"\n' + ENTRY + 'when="mlp_bias"\nsetting="speculative_nonsense"\n', "setting"),
    ('[[known]]\narea="settings"\n' + ENTRY + 'when="mlp_bias"\nsetting="lm_head"\nshown_by="nothing"\n', "shown_by"),
    ('[[known]]\narea="settings"\n' + ENTRY + 'when="mlp_bias"\nsetting="lm_head"\nasserted="yes"\n', "asserted"),
    ('[[known]]\narea="engine"\n' + ENTRY + 'when="chunked_prefill"\nround=0\nstep=0\nstage="input_ids"\n'
     'rows="some rows"\n', "rows"),
    ('[[known]]\narea="engine"\n' + ENTRY + 'when="chunked_prefill"\nround="first"\nstep=0\nstage="input_ids"\n'
     'rows="partial chunk ends embed the prompt\'s last token"\n', "round"),
    ('[[known]]\narea="engine"\n' + ENTRY + 'when="mlp_bias"\nround=0\nstep=0\nstage="input_ids"\n'
     'rows="partial chunk ends embed the prompt\'s last token"\n', "mlp_bias"),
    ('[[divergence]]\n' + ENTRY, "[[known]]"),
    ('[[known]\n', "not valid TOML"),
], ids=["unknown_knob", "call", "unknown_impl", "unknown_stage", "missing_field", "bad_range", "unknown_area",
        "bad_regex", "bad_kind", "name_of_another_area", "error_kind_without_exception", "exception_on_other_kind",
        "bad_problem", "no_tensors", "bad_setting", "bad_shown_by", "bad_asserted", "engine_bad_rows",
        "engine_bad_round", "engine_name_of_another_area", "old_table", "bad_toml"])
def test_a_malformed_registry_is_a_one_line_error(text, field, tmp_path: Path):
    path = tmp_path / "registry.toml"
    path.write_text(text)
    with pytest.raises(RegistryError) as info:
        load_registry(path)
    message = str(info.value)
    assert "\n" not in message and path.name in message and field in message, message


@pytest.mark.parametrize("entry", entries_of_area("engine"), ids=by_id)
def test_an_engine_entry_matches_only_its_place_and_rows(entry):
    """An engine entry (its evidence is the engine lane's, e.g. `make vllm-engine`) explains a served divergence at
    exactly its round, step, stage and rows; another round, step, stage or rows is unexplained, and a request
    that conformed has nothing to explain."""
    place = (entry.round, entry.step, entry.stage)
    assert judge("engine", [entry], ServedDivergence(place, entry.rows)).hits == [entry]
    others = [ServedDivergence((entry.round + 1, entry.step, entry.stage), entry.rows),
              ServedDivergence((entry.round, entry.step + 1, entry.stage), entry.rows),
              ServedDivergence((entry.round, entry.step, "aux_in"), entry.rows), ServedDivergence(place, "other")]
    for seen in others:
        found = judge("engine", [entry], seen)
        assert not found.hits and found.unexplained, (seen, found)
    assert not judge("engine", [entry], ServedDivergence(None)).explained


def test_an_engine_entry_holds_for_the_version_the_engine_ran(monkeypatch):
    """An engine entry's range is held against the build its engine ran (vLLM's CPU build in its own environment),
    not the implementation's model-level install: a planted engine version outside the range makes it not apply."""
    entry = entries_of_area("engine")[0]
    names = {"K": 2, "chunked_prefill": True, "prefix_caching": True, "format": "speculators", "layers": 1,
             "runner": "v1"}
    inside = str(next(iter(SpecifierSet(entry.versions))).version)
    for version, holds in ((inside, True), ("0.0.1", False)):
        monkeypatch.setitem(registry._ENGINES, entry.impl, lambda v=version: v)
        registry.installed_version.cache_clear()
        try:
            assert (entry in registry.applicable("engine", entry.impl, names)) is holds, (version, entry.versions)
        finally:
            registry.installed_version.cache_clear()


def test_readme_support_matrix_is_current():
    """The generated block of docs/registry.md (the README's support matrix until it moved there)."""
    from conformance.session.support_matrix import DOC, doc_block

    assert doc_block() in DOC.read_text(), f"{DOC.name}'s support matrix is stale: run `make support-matrix`"


# ---------------------------------------------------------------- neutrals (what the property tests apply)

@pytest.fixture(scope="module")
def neutral_store(tmp_path_factory):
    from conformance.session.harness import NeutralStore

    return NeutralStore(tmp_path_factory.mktemp("neutralised"))


@pytest.mark.parametrize("entry", entries("draft", "load"), ids=by_id)
def test_draft_and_load_entries_are_neutralised_by_their_neutral(entry, neutral_store):
    """Every draft and load entry has a neutral, and on every case it applies to, in every dtype, the case with
    every implementation's entries neutralised (as the property tests run it) no longer matches the entry: its
    condition is false (a `neutral`) and its implementation conforms at every stage of two draft steps."""
    from conformance.adapters import IMPLEMENTATIONS
    from conformance.core.registry import case_names, neutralised

    assert entry.neutral or entry.neutral_weights, f"{entry.id}: no neutral, so the property tests cannot clean it"
    cases = [c for c in runnable_cases(entry.impl) if entry in for_case(entry.impl, c)]
    assert cases, f"{entry.id}: applies to no case"
    problems = []
    for case in cases:
        assert neutralised(case, [entry.impl], registry=(entry,)).entries == (entry,)   # its own neutral alone
        variant = neutralised(case, list(dict.fromkeys((*IMPLEMENTATIONS, entry.impl))))   # also a lane of its own
        if (entry.neutral_weights and entry not in variant.entries) or (
                entry.neutral and entry.condition_holds(case_names(variant.case))):
            problems.append(f"{entry.id}: still applies to {variant.case.id}")
        for dtype_name in sorted(DTYPES):
            try:
                first = compare_with_reference(neutral_store, entry.impl, neutral_store.use(variant), dtype_name,
                                               steps=2).first_divergence
            except LoadFailed as exc:
                problems.append(f"{entry.id}: {variant.case.id} in {dtype_name}: {exc}")
                continue
            if first is not None:
                problems.append(f"{entry.id}: {variant.case.id} in {dtype_name} diverges at step {first.step} "
                                f"`{first.stage}` (max abs {first.max_abs})")
    assert not problems, "neutral does not neutralise:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("change", [{"neutral": ()}, {"neutral": (("norm_before_residual", "True"),)}],
                         ids=["neutral_removed", "neutral_leaves_condition_true"])
def test_a_registry_without_a_working_neutral_fails_the_property_tests_loudly(change, monkeypatch):
    """The property tests draw clean configurations from the registry, not from a list of knobs: an entry whose
    neutral is removed, or does not make its condition false, is a one-line RegistryError naming it."""
    from conformance.draft.strategies import variants

    case = CASES_BY_ID["norm_before_residual"]
    real = next(e for e in REGISTRY if e.id == "sglang-residual-never-normed")
    assert variants(case, clean=True)[0].entries == (real,)
    monkeypatch.setattr(registry, "REGISTRY", tuple(dataclasses.replace(e, **change) if e is real else e
                                                    for e in REGISTRY))
    with pytest.raises(RegistryError) as info:
        variants(case, clean=True)
    message = str(info.value)
    assert "\n" not in message and real.id in message and "neutral" in message, message


@pytest.mark.parametrize("field,value", [
    ("neutral", '"mlp_bias"'),
    ("neutral", '{ no_such_knob = "1" }'),
    ("neutral", '{ mlp_bias = "__import__(1)" }'),
    ("neutral", '{ mlp_bias = false }'),
    ("neutral", '{ attention_bias = "False" }'),
    ("neutral_weights", '["(unclosed"]'),
    ("neutral_weights", '[]'),
], ids=["not_a_table", "unknown_knob", "call", "not_an_expression", "not_read_by_the_condition", "bad_regex",
        "empty_weights"])
def test_a_malformed_neutral_is_a_one_line_error(field, value, tmp_path: Path):
    path = tmp_path / "registry.toml"
    path.write_text(f'[[known]]\narea="draft"\n{ENTRY}when="mlp_bias"\nstep=0\nstage="layers.0.mlp_out"\n'
                    f"{field} = {value}\n")
    with pytest.raises(RegistryError) as info:
        load_registry(path)
    message = str(info.value)
    assert "\n" not in message and path.name in message and f"'{field}'" in message, message
