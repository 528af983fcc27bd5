"""Target-side wiring, the other servers: the same draft configs SGLang's wiring tests serve (every target
class x training case x config format), read by each other serving implementation's own code (its adapter's
`served_boundaries`: vLLM's config readers and the ids its model runner passes to the target), compared
slot by slot with what training captured; and one report row per config saying which layers SGLang and each
other server feed. A registered `wiring` entry of that implementation makes its case a strict xfail that
only counts with exactly that kind of mismatch.

These tests run in the implementation's own lane (e.g. `make vllm`), never in the default one.
"""
from __future__ import annotations

import dataclasses

import pytest

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS
from conformance.checkpoints.knobs import DEFAULTED
from conformance.core.areas import Reading
from conformance.core.matching import judge, known_param, match_wiring, settle
from conformance.core.registry import applicable
from conformance.core.sections import Section
from conformance.wiring.cases import (
    CAPTURE_FAILED, REFUSED, N, WiringCase, boundary_name, layer_list, runners, wiring_matrix, wiring_names,
)
from conformance.wiring.comparison import WiringComparison
from fixtures.targets import CAPTURE_ONLY_TARGETS, TARGETS, TargetSpec, write_target_config

pytestmark = pytest.mark.cpu

SERVERS = [impl for impl in ALL_IMPLEMENTATIONS if ADAPTERS[impl].served_boundaries is not None]


def known(impl: str, target: TargetSpec, case: WiringCase, fmt: str, runner: str | None = None):
    return applicable("wiring", impl, wiring_names(target, case, fmt, runner))


def params():
    for impl in SERVERS:
        for runner in runners(impl):   # vLLM: its V2 runner (a CUDA server's default) and its V1 runner
            for target, case, fmt in wiring_matrix(TARGETS + CAPTURE_ONLY_TARGETS):
                yield known_param(impl, runner, target, case, fmt, id=f"{impl}-{runner}-{target.id}-{case.id}-{fmt}",
                                  known=known(impl, target, case, fmt, runner)[:1])


def served_comparison(impl: str, target: TargetSpec, case: WiringCase, fmt: str, wiring, root,
                      runner: str | None = None) -> tuple[WiringComparison, dict]:
    """What `impl` (with that model runner) feeds the draft for this config, as a WiringComparison against
    training, and the adapter's answer: observed where its target class ran here, else derived (see the
    adapter's wiring module)."""
    config = write_target_config(target, root / target.id) / "config.json"
    served = ADAPTERS[impl]().served_boundaries(wiring.draft_dir(case, fmt), config, N, runner)
    case_id = f"{target.id}-{case.id}-{fmt}" + (f" ({runner} runner)" if runner else "")
    error_kind = "" if not served["error"] else (REFUSED if served["read"] == "nothing" else CAPTURE_FAILED)
    names = None if served["served"] is None else tuple(boundary_name(b) for b in served["served"])
    return WiringComparison(case_id, case.boundaries, served["read"], served["served"], names,
                            # compared as boundary lists (derived=True): an observed list too, since its states
                            # were matched to boundaries of vLLM's own forward, not to training's tensors
                            error=served["error"], kind_of_error=error_kind, derived=True,
                            trained=case.describe(), error_class=served["error_class"]), served


def message(impl: str, comparison: WiringComparison, repro: str, observed: bool = False) -> str:
    serving = "(none)" if comparison.serving is None else layer_list(comparison.serving)
    lines = [f"{impl} vs training [{comparison.case_id}]: the draft is not fed what it was trained on "
             f"({comparison.kind})",
             f"  training: {layer_list(comparison.training)}  serving: {serving} "
             + ("(observed: its target class's forward)" if observed
                else "(derived from the ids it passes the target; no forward)"),
             f"  trained with {comparison.trained}", f"  {impl} read {comparison.read}"]
    if comparison.error:
        lines.append(f"  {comparison.error}")
    train = [boundary_name(b) for b in comparison.training]
    served = list(comparison.serving or ())
    for slot in range(max(len(train), len(served))):
        t = train[slot] if slot < len(train) else "(none)"
        s = served[slot] if slot < len(served) else "(none)"
        lines.append(f"  slot {slot}: training {t}, serving {s}  " + ("ok" if t == s else "<- differs"))
    lines.append(f"  repro: {repro}")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def server_targets(tmp_path_factory):
    return tmp_path_factory.mktemp("server_targets")


@pytest.mark.parametrize("impl,runner,target,case,fmt", list(params()))
def test_server_feeds_what_training_captured(impl, runner, target, case, fmt, wiring, server_targets, report, repro):
    comparison, served = served_comparison(impl, target, case, fmt, wiring, server_targets, runner)
    # the capture rule checked where the class ran: its list, or no list where vLLM raised (a None residual)
    if served["observed"] and (not served["error"] or served["error_class"]):
        assert served["served"] == served["derived"], (
            f"{impl} [{comparison.case_id}]: its target class captured {served['served']}, the capture rule (the "
            f"adapter's wiring module) derives {served['derived']}\n  repro: {repro}")
    if target.no_forward:
        sglang = wiring.capture_ids_only(target, case, fmt)
    else:
        sglang, _ = wiring.serve(target, case, fmt)
    ok, kind = comparison.ok, comparison.kind
    hit = None if ok else match_wiring(known(impl, target, case, fmt, runner)[:1], comparison.observed)
    outcome = "pass" if ok else (f"known: {kind}" if hit else f"FAIL: {kind}")
    report.add_row(Section.WIRING_SERVERS, {
        "Case": comparison.case_id, "training captured": layer_list(case.boundaries),
        "SGLang feeds": "-" if sglang.serving is None else layer_list(sglang.serving),
        f"{impl} read": comparison.read,
        f"{impl} feeds": f"error: {comparison.error}" if comparison.error else layer_list(comparison.serving or ()),
        f"{impl} how": "observed: its target class ran" if served["observed"] else f"derived: {served['derived_why']}",
        f"{impl} outcome": outcome})
    if not ok:
        settle(message(impl, comparison, repro, served["observed"]), hit)


@pytest.mark.parametrize("impl", SERVERS)
def test_a_shifted_config_is_caught(impl, wiring, server_targets, repro):
    """Planted: the speculators-format config of a case that conforms, its ids rewritten one layer deeper:
    the server's reading follows the file, and the comparison reports the shift."""
    import json

    from conformance.wiring.cases import CASES_BY_ID, DEEPER

    target, case = TARGETS[0], CASES_BY_ID["speculators_explicit"]
    draft_dir = wiring.draft_dir(case, "speculators")
    planted = server_targets / "planted" / impl
    planted.mkdir(parents=True, exist_ok=True)
    config = json.loads((draft_dir / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [b + 1 for b in case.boundaries]
    (planted / "config.json").write_text(json.dumps(config))
    served = ADAPTERS[impl]().served_boundaries(planted, write_target_config(target, server_targets / "t")
                                                / "config.json", N)
    assert served["served"] == tuple(b + 1 for b in case.boundaries), f"{impl}: {served} ({repro})"
    shifted = WiringComparison("planted", case.boundaries, served["read"], served["served"],
                               tuple(boundary_name(b) for b in served["served"]), derived=True)
    assert not shifted.ok and shifted.kind == DEEPER, message(impl, shifted, repro, served["observed"])


# ---------------------------------------------------------------- the draft's knobs as each server reads them

# A key a speculators-format config may leave out: the reading speculators itself gives it (its config
# class's default) must be the server's. Where a server reads the absent key otherwise, the registry's
# `reading` entry says so (registry.toml), and the param is a strict xfail that only counts with that reading.
ABSENT_KEYS = DEFAULTED


def absent_known(impl: str, key: str):
    from fixtures.tiny import make_config

    names = {**dataclasses.asdict(make_config()), "format": "speculators", "absent": (key,), "overruled": ()}
    return [e for e in applicable("reading", impl, names) if e.key == key]


def absent_key_params():
    for impl in SERVERS:
        for key in ABSENT_KEYS:
            yield known_param(impl, key, id=f"{impl}-{key}", known=absent_known(impl, key))


@pytest.mark.parametrize("impl,key", list(absent_key_params()))
def test_server_reads_an_absent_knob_as_training(impl, key, server_targets, repro):
    import json

    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from fixtures.checkpoint import speculators_config_json
    from fixtures.tiny import make_config

    config = speculators_config_json(make_config())
    del config[key]
    draft = server_targets / "absent" / key
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    training = bool(getattr(Eagle3SpeculatorConfig.from_pretrained(draft), key))
    served = ADAPTERS[impl]().served_boundaries(draft, write_target_config(TARGETS[0], server_targets / "t")
                                                / "config.json", N)
    assert not served["error"], served["error"]
    reading = served["reading"].get(key)
    if reading != training:
        settle(f"{impl} reads a speculators-format config without {key} as {reading}, speculators as {training}\n"
               f"  repro: {repro}", judge("reading", absent_known(impl, key), Reading(key, str(reading).lower())).hits)
