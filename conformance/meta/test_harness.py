"""Self-tests of the harness: planted divergences are caught at the right stage with a full message,
adapters honour their Protocol and claims, tolerances and cases are well formed, the registry is live.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from conformance.core import stages
from conformance.adapters import ADAPTERS, DEFAULT_SERVER, DEFAULT_TRAINER, IMPLEMENTATIONS, REFERENCE
from conformance.adapters.base import AdapterBase, DraftAdapter, LoadedDraft
from conformance.core.compare import compare_traces
from conformance.core.tolerances import DTYPES
from conformance.core.tolerances import TOLERANCES, tol_for
from fixtures.cases import ALL_CASES, CASES_BY_ID
from conformance.checkpoints import WEIGHTS_FILE, read_weights, sha256
from fixtures.checkpoint import FORMATS, edited_copy
from reference.eagle3 import Eagle3Reference

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
GQA = CASES_BY_ID["gqa"]


def planted_checkpoint(drafts, case, fmt, tmp_path, edit):
    """A copy of the case's checkpoint in `fmt` with `edit(weights)` applied; the original is untouched."""
    return edited_copy(drafts.checkpoint(case)[fmt], tmp_path / fmt, edit)


def compare_planted(drafts, impl, case, ckpt_dir, batch=None):
    dtype = torch.float32
    actual = ADAPTERS[impl]().load(ckpt_dir, dtype).run(batch or drafts.batch(case))
    expected = drafts.trace("reference", case, dtype)
    return compare_traces(actual, expected, case.id)


def assert_names_stage(comparison, stage: str, step: int = 0):
    __tracebackhide__ = True
    first = comparison.first_divergence
    assert first is not None, f"planted divergence not caught: {comparison.pair} [{comparison.case_id}]"
    assert (first.step, first.stage) == (step, stage), f"expected '{stage}', got:\n{comparison.message('-')}"
    message = comparison.message("python -m pytest 'x::y'")
    for part in (comparison.pair, comparison.case_id, f"step {step}", f"stage '{stage}'", "max abs error",
                 "max rel error", "repro: python -m pytest"):
        assert part in message, f"failure message lacks {part!r}:\n{message}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_perturbed_norm_weight_is_named(impl, drafts, tmp_path):
    def edit(w):
        w["layers.0.hidden_norm.weight"][3] += 0.5
    ckpt = planted_checkpoint(drafts, GQA, ADAPTERS[impl].checkpoint_format, tmp_path, edit)
    assert_names_stage(compare_planted(drafts, impl, GQA, ckpt), "layers.0.hidden_norm")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_aux_chunks_in_another_order_are_named(impl, drafts, tmp_path):
    """The model expects another chunk order (fc columns permuted): aux_in agrees, fc_out does not."""
    H = GQA.config.target_hidden_size

    def edit(w):
        w["fc.weight"] = torch.cat([w["fc.weight"][:, H:2 * H], w["fc.weight"][:, :H], w["fc.weight"][:, 2 * H:]], 1)
    ckpt = planted_checkpoint(drafts, GQA, ADAPTERS[impl].checkpoint_format, tmp_path, edit)
    assert_names_stage(compare_planted(drafts, impl, GQA, ckpt), "fc_out")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_aux_input_in_another_order_is_named(impl, drafts):
    """The serving side hands the chunks over in another order: the very first stage differs."""
    batch = drafts.batch(GQA)
    a = batch.aux.chunk(3, dim=-1)
    batch.aux = torch.cat([a[2], a[0], a[1]], dim=-1)
    ckpt = drafts.checkpoint(GQA)[ADAPTERS[impl].checkpoint_format]
    assert_names_stage(compare_planted(drafts, impl, GQA, ckpt, batch), "aux_in")


def test_residual_after_norm_is_named(drafts):
    """A residual taken after hidden_norm instead of before it (the reference with the knob flipped)."""
    from dataclasses import replace
    from conformance.checkpoints import read_weights

    ckpt = drafts.checkpoint(GQA)["speculators"]
    planted = Eagle3Reference(replace(GQA.config, norm_before_residual=True), read_weights(ckpt), torch.float32)
    from conformance.core.trace import Trace
    expected = drafts.trace("reference", GQA, torch.float32)
    actual = Trace("planted", torch.float32, planted.run(drafts.batch(GQA)), [{}],
                   claimed_stages=expected.claimed_stages, num_layers=expected.num_layers)
    comparison = compare_traces(actual, expected, GQA.id)
    assert_names_stage(comparison, "layers.0.residual")


def protocol_members(protocol) -> set[str]:
    return set(protocol.__annotations__) | {name for name in vars(protocol) if not name.startswith("_")}


@pytest.mark.parametrize("impl", ["reference", *IMPLEMENTATIONS])
def test_adapter_honours_protocol(impl):
    adapter = ADAPTERS[impl]
    missing = sorted(m for m in protocol_members(DraftAdapter) if not hasattr(adapter, m))
    assert not missing, f"{impl} adapter is missing {missing} (conformance/adapters/base.py DraftAdapter)"
    assert adapter.name == impl
    # The package its version comes from is installed (the registry's version ranges are matched against it).
    assert (adapter.package is None) == (impl == REFERENCE) and (adapter.package is None or adapter.version())
    assert adapter.checkpoint_format in FORMATS
    unknown = adapter.claimed_stages - set(stages.PRE + stages.LAYER + stages.POST)
    assert not unknown, f"{impl} claims stages that are not canonical: {sorted(unknown)}"


def role_problems(adapters: dict) -> list[str]:
    """What contradicts an adapter's declared role: one default server, and a server; a server's capabilities
    (model runners, formats it serves, the boundaries it feeds, its in-process machinery) on servers only, a
    training path on trainers only; every adapter takes its defaults from AdapterBase."""
    out = [f"{n}: does not derive AdapterBase" for n, a in adapters.items() if not issubclass(a, AdapterBase)]
    adapters = {n: a for n, a in adapters.items() if issubclass(a, AdapterBase)}
    defaults = [n for n, a in adapters.items() if a.default_server]
    out += [] if len(defaults) == 1 and adapters[defaults[0]].is_server else [f"default servers: {defaults}"]
    for n, a in adapters.items():
        served = [c for c in ("runners", "other_formats", "served_boundaries", "target_capture", "server_settings",
                              "engine", "cpu_compile_fails") if getattr(a, c) != getattr(AdapterBase, c)]
        out += [f"{n}: {served} without is_server"] if served and not a.is_server else []
        trained = [c for c in ("training", "training_capture", "save_checkpoint") if getattr(a, c) is not None]
        out += [f"{n}: {trained} without is_trainer"] if trained and not a.is_trainer else []
    return out


def test_adapter_roles_are_consistent():
    assert not role_problems(ADAPTERS), role_problems(ADAPTERS)
    assert ADAPTERS[DEFAULT_TRAINER].is_trainer and not ADAPTERS[REFERENCE].is_server and DEFAULT_SERVER != REFERENCE


def test_planted_role_contradictions_are_named():
    class Stray(ADAPTERS[REFERENCE]):   # the reference, claiming a server's engine, the default and a trainer's capture
        engine = ADAPTERS[DEFAULT_SERVER].engine
        default_server = True
        training_capture = ADAPTERS[DEFAULT_SERVER].engine

    class Bare:   # declares its own, no defaults
        name = "bare"

    problems = role_problems({**ADAPTERS, "stray": Stray, "bare": Bare})
    assert "bare: does not derive AdapterBase" in problems and "stray: ['engine'] without is_server" in problems
    assert "stray: ['training_capture'] without is_trainer" in problems, problems
    assert f"default servers: {[DEFAULT_SERVER, 'stray']}" in problems, problems


@pytest.mark.parametrize("impl", ["reference", *IMPLEMENTATIONS])
def test_loaded_draft_honours_protocol(impl, drafts):
    ckpt = drafts.checkpoint(GQA)[ADAPTERS[impl].checkpoint_format]
    loaded = ADAPTERS[impl]().load(ckpt, torch.float32)
    missing = sorted(m for m in protocol_members(LoadedDraft) if not hasattr(loaded, m))
    assert not missing, f"{impl}'s loaded draft is missing {missing} (conformance/adapters/base.py LoadedDraft)"
    assert "record" in inspect.signature(loaded.run).parameters, f"{impl}: run() takes no `record`"


@pytest.mark.parametrize("impl", ["reference", *IMPLEMENTATIONS])
@pytest.mark.parametrize("case_id", ["norm_before_fc", "two_layers"])
def test_trace_has_every_claimed_stage(impl, case_id, drafts):
    case = CASES_BY_ID[case_id]
    if why := ADAPTERS[impl]().unsupported(case.config):
        pytest.skip(why)
    trace = drafts.trace(impl, case, torch.float32)
    expected = drafts.trace("reference", case, torch.float32)
    claimed = ADAPTERS[impl].claimed_stages
    # What compare_traces reads from the trace: the adapter's claims, the checkpoint's layer count.
    assert (trace.claimed_stages, trace.num_layers) == (claimed, case.config.num_hidden_layers)
    missing = [s for s in expected.steps[0] if s.rsplit(".", 1)[-1] in claimed and s not in trace.steps[0]]
    assert not missing, f"{impl} claims but did not produce: {missing}"
    extra = set(trace.steps[0]) - set(stages.stage_names(case.config.num_hidden_layers))
    assert not extra, f"{impl} produced non-canonical stages: {sorted(extra)}"


def test_formats_share_the_same_weight_bytes(drafts):
    dirs = drafts.checkpoint(GQA)
    # Formats storing other tensor names (SpecForge's midlayer.*) hold the same tensors, bit for bit.
    renamed = {fmt for fmt, d in dirs.items() if set(read_weights(d, stored_names=True)) != set(read_weights(d))}
    digests = {fmt: sha256(d / WEIGHTS_FILE) for fmt, d in dirs.items() if fmt not in renamed}
    assert len(set(digests.values())) == 1, f"weight files differ between formats: {digests}"
    first = read_weights(dirs[next(iter(digests))])
    for fmt in renamed:
        tensors = read_weights(dirs[fmt])
        assert tensors.keys() == first.keys() and all(torch.equal(tensors[k], first[k]) for k in first), fmt


def test_tolerance_table_covers_every_stage_kind_and_dtype():
    kinds = {stages.stage_kind(s) for s in stages.stage_names(2)}
    assert kinds == {"hidden", "logits", "ids"}
    for kind in kinds:
        for dtype in (*DTYPES.values(), torch.float64):
            tol = tol_for(kind, dtype)
            assert tol.atol >= 0 and tol.rtol >= 0
    assert all(t.atol == 0 and t.rtol == 0 for (k, _), t in TOLERANCES.items() if k == "ids")
    with pytest.raises(KeyError, match="no tolerance"):
        tol_for("hidden", torch.int8)


def test_case_ids_are_unique_and_readable():
    ids = [c.id for c in ALL_CASES]
    assert len(ids) == len(set(ids)), f"duplicate case ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert all(i.replace("_", "").isalnum() for i in ids), ids


def test_stage_names_are_unique_and_ordered():
    names = stages.stage_names(3)
    assert len(names) == len(set(names))
    order = [names.index(s) for s in ("fc_out", "layers.0.hidden_norm", "layers.2.layer_out", "logits")]
    assert order == sorted(order), order
    assert "layers.1.embeds_norm" not in names


@pytest.mark.parametrize("impl", ["reference", *IMPLEMENTATIONS])
def test_runs_are_bitwise_deterministic(impl, drafts):
    """Two loads and runs of the same checkpoint on the same inputs give identical stages."""
    case = next(c for c in (CASES_BY_ID["norm_before_fc"], GQA) if ADAPTERS[impl]().unsupported(c.config) is None)
    ckpt = drafts.checkpoint(case)[ADAPTERS[impl].checkpoint_format]
    first, second = (ADAPTERS[impl]().load(ckpt, torch.bfloat16).run(drafts.batch(case)) for _ in range(2))
    differing = [s for s in first.steps[0] if not torch.equal(first.steps[0][s], second.steps[0][s])]
    assert not differing, f"{impl}: stages differ between two identical runs: {differing}"


def test_sglang_cpu_adjustment_is_the_documented_one():
    """The only runtime adjustment: SGLang's rotary module treats this host as a CPU (adapters/sglang/runtime.py)."""
    from conformance.adapters.sglang.runtime import ensure_runtime

    runtime = ensure_runtime()
    adjustments = runtime["adjustments"]
    assert set(adjustments) == {"sglang.srt.layers.rotary_embedding.base._is_cpu"}, adjustments
    from sglang.srt.layers.rotary_embedding import base as rope_base
    assert rope_base._is_cpu is True




def load_collection_failures(context) -> list[str]:
    """What is wrong with `context` as the frame of a NeMo load: a cycle made during it must be freed by the
    load's own gc.collect(); one alive before must survive that collection (frozen) and be collectable after."""
    import gc
    import weakref

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    out = []
    gc.disable()   # no automatic collection between the steps: only the explicit ones below
    try:
        before = cycle()   # garbage from the start, but only a collection finds a cycle
        with context():
            during = cycle()
            gc.collect()   # what NeMo's load_model does at its end
            if during() is not None:
                out.append("a cycle made during the load was not collected by the load's collection")
            if before() is None:
                out.append("the load's collection walked the objects alive before it (not frozen)")
        if gc.get_freeze_count():
            out.append("the heap stayed frozen after the load")
        gc.unfreeze()
        gc.collect()
        if before() is not None:
            out.append("a cycle from before the load was kept past the load")
    finally:
        gc.enable()
    return out


def test_nemo_load_collections():
    """NeMo's loads run with the heap alive before them frozen (adapters/nemo/checkpoint.py): its gc.collect()
    inside frees what the load made, not what was alive before, and after the load nothing stays frozen. Planted:
    a frame that never freezes, and one that never unfreezes, each fail."""
    import contextlib
    import gc

    from conformance.adapters.nemo.checkpoint import collections_see_only_new_objects

    if gc.get_freeze_count():
        pytest.skip("this process froze its heap already (the frame then leaves the older objects frozen)")

    @contextlib.contextmanager
    def never_frozen():
        yield

    @contextlib.contextmanager
    def never_unfrozen():
        gc.freeze()
        yield

    assert load_collection_failures(collections_see_only_new_objects) == []
    assert load_collection_failures(never_frozen) == [
        "the load's collection walked the objects alive before it (not frozen)"]
    assert load_collection_failures(never_unfrozen) == ["the heap stayed frozen after the load"]
