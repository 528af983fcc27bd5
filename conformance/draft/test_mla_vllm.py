"""vLLM 0.33.0's MLA EAGLE-3 draft (vllm/model_executor/models/deepseek_eagle3.py, `Eagle3DeepseekV2ForCausalLM`) on
this CPU, without its forward (the adapter's forward_not_run: its MLA attention needs a compiled op of vLLM's CPU
build). For every built-in MLA case, in the format its published drafts come in (the adapter's format_for), and for
the published MLA draft configs (fixtures/data/real-configs/mla/):
- its config reading: vLLM's own resolution (EngineArgs -> SpeculativeConfig -> the draft's ModelConfig) and the
  class it builds from it, with every knob read off the built modules (conformance/adapters/vllm/mla.py `observed`),
  against what the reference reads from the same file, and its rope table at every position the case's steps use;
  each difference is a registry `reading` entry of the format (a strict xfail that matches only its own key and
  reading);
- its weight loading: its real `load_weights` observed, every tensor landing bit for bit (q_a_proj and
  kv_a_proj_with_mqa in their rows of fused_qkv_a_proj) or named, as the Llama draft's accounting.
Planted: a renamed tensor and a missing one are named; a reading the registry does not state fails; a rope table
scaled once more by yarn's mscale fails.
Run with the adapter (`impl`), so that these tests join its lane (`pytest -m vllm`).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS, account
from conformance.checkpoints import read_config, read_config_file
from conformance.core.areas import Reading
from conformance.core.matching import judge, known_param, settle, settle_accounting
from conformance.core.registry import Known, applicable, case_names, for_accounting
from fixtures.cases import CASES_BY_ID, MLA_STEP0_CASES
from fixtures.checkpoint import edited_copy
from fixtures.real_configs import REAL_CONFIGS

pytestmark = pytest.mark.cpu
IMPLS = [impl for impl in ALL_IMPLEMENTATIONS if ADAPTERS[impl].mla_checks is not None]
PUBLISHED = sorted((REAL_CONFIGS / "mla").glob("*.json"))
BASE = CASES_BY_ID["mla_q_lora"]


def known_readings(impl: str, case, fmt: str) -> tuple[Known, ...]:
    """The registered readings of `impl` that apply to the case in `fmt` (a file the suite writes states every
    key: nothing absent or overruled)."""
    return applicable("reading", impl, {**case_names(case), "format": fmt, "absent": (), "overruled": ()})


def known_for_reading(impl: str, case) -> tuple[Known, ...]:
    """The readings of a draft that vLLM builds (an entry with an error is the load's: known_for_accounting)."""
    return tuple(e for e in known_readings(impl, case, ADAPTERS[impl]().format_for(case.config)) if not e.error)


def known_for_accounting(impl: str, case) -> tuple[Known, ...]:
    """The accounting and load entries of the case, and its format's readings that refuse the load, as load entries
    (as conformance/draft/test_served_formats.py takes them)."""
    refusals = [dataclasses.replace(e, area="load") for e in
                known_readings(impl, case, ADAPTERS[impl]().format_for(case.config)) if e.error]
    return (*for_accounting(impl, case), *refusals)


def settle_readings(impl: str, found: list[tuple[str, object, object]], known, head: str, repro: str) -> None:
    """Pass when vLLM reads the file as the reference does; KnownDivergenceHit only when registered readings state
    every difference (key and reading, exactly); a difference none states fails, and so does an entry that states
    one not seen (the strict xfail passes)."""
    __tracebackhide__ = True
    if not found:
        return
    hits, unexplained = [], []
    for key, theirs, ours in found:
        match = judge("reading", known, Reading(key, str(theirs)))
        hits += [e for e in match.hits if e not in hits]
        unexplained += [f"{key}: {impl} reads {theirs!r}, the reference {ours!r}" for _ in match.unexplained]
    lines = [f"{head}: " + "; ".join(f"{k}: {impl} {t!r}, reference {o!r}" for k, t, o in found)]
    if unexplained:
        lines.append("  not stated by the registry: " + "; ".join(unexplained))
    settle("\n".join(lines + [f"  repro: {repro}"]), [] if unexplained else hits)


def rope_positions(drafts, case, steps: int = 3) -> torch.Tensor:
    """Every position the case's first `steps` draft steps turn: its batch's positions and each last one + k."""
    positions = drafts.batch(case).positions
    return torch.unique(torch.cat([positions + k for k in range(steps)]))


def reading_params():
    for impl in IMPLS:
        for case in MLA_STEP0_CASES:
            yield known_param(impl, case, id=f"{impl}-{case.id}", known=known_for_reading(impl, case))


@pytest.mark.parametrize("impl,case", list(reading_params()))
def test_mla_config_is_read_as_the_reference_reads_it(impl, case, drafts, repro):
    adapter = ADAPTERS[impl]()
    directory = drafts.directory(impl, case)
    positions = rope_positions(drafts, case)
    seen = adapter.mla_checks.reading(directory, positions)
    reference = read_config(directory)
    found = adapter.mla_checks.differences(seen, reference)
    # its rope table at every position the case's draft steps use, against the reference's
    for half, result in zip(("cos", "sin"), adapter.mla_checks.rope_against_reference(seen, reference, positions)):
        if result.failed:
            found.append((f"rope table {half}", f"max abs {result.max_abs:.3e} (rel {result.max_rel:.3e}) at "
                          f"(position row, pair) {result.abs_index}, {result.excess:.3g}x the allowed error",
                          "the reference's table"))
    settle_readings(impl, found, known_for_reading(impl, case), f"{impl} MLA config reading [{case.id}]", repro)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", PUBLISHED, ids=[p.stem for p in PUBLISHED])
def test_published_mla_config_resolves_to_the_mla_draft(impl, path, tmp_path):
    """The published config as written, resolved by vLLM alone (its real size is not built here): the MLA class, and
    every latent width, rope block and vocabulary the reference reads."""
    directory = tmp_path / path.stem   # the file alone: vLLM reads a directory, the reference the file
    directory.mkdir()
    (directory / "config.json").write_text(path.read_text())
    seen = ADAPTERS[impl].mla_checks.config_reading(directory)
    cfg = read_config_file(path).config(path)
    assert seen["class"] == json.loads(path.read_text())["architectures"][0], seen
    widths = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size", "draft_vocab_size")
    assert {k: seen[k] for k in widths} == {k: getattr(cfg, k) for k in widths}
    scaling = {k: v for k, v in seen["rope_parameters"].items() if k not in ("rope_type", "type", "rope_theta")}
    assert scaling == {k: v for k, v in cfg.rope_scaling.items() if k not in ("rope_type", "type")}
    assert seen["rope_parameters"]["rope_theta"] == cfg.rope_theta


@pytest.mark.parametrize("case,impl", [known_param(case, impl, id=f"{case.id}-{impl}",
                                                   known=known_for_accounting(impl, case))
                                       for case in MLA_STEP0_CASES for impl in IMPLS])
def test_every_mla_tensor_lands_bit_for_bit(case, impl, drafts, report, repro):
    from conformance.core.sections import Section

    acct = account(impl, drafts.directory(impl, case))
    report.add_row(Section.WEIGHT_ACCOUNTING, acct.row(case.id))
    settle_accounting(acct, known_for_accounting(impl, case), f"{impl} MLA weight accounting [{case.id}]", repro)
    cfg, landed = case.config, dict(acct.landed)
    if cfg.q_lora_rank is not None:   # the two down projections in their rows of the one fused parameter
        fused, q, kv = ("model.layers.0.self_attn.fused_qkv_a_proj.weight", cfg.q_lora_rank,
                        cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert landed["layers.0.self_attn.q_a_proj.weight"] == f"{fused}[0:{q}]", acct.landed
        assert landed["layers.0.self_attn.kv_a_proj_with_mqa.weight"] == f"{fused}[{q}:{q + kv}]", acct.landed
    assert landed["layers.0.self_attn.kv_b_proj.weight"] == "model.layers.0.self_attn.kv_b_proj.weight"
    # its absorbed halves, derived from it at load, checked against the stored tensor
    assert sum("derived from kv_b_proj" in i for i in acct.ignored) == 2, acct.ignored


# ---------------------------------------------------------------- planted (harness self-tests)

@pytest.mark.meta
@pytest.mark.parametrize("impl", IMPLS)
def test_a_renamed_mla_tensor_is_named(impl, drafts, tmp_path, repro):
    """kv_b_proj stored under another name: vLLM's loader must not take it silently; the account names it."""
    def edit(w):
        w["layers.0.self_attn.kv_up_proj.weight"] = w.pop("layers.0.self_attn.kv_b_proj.weight")
    planted = edited_copy(drafts.directory(impl, BASE), tmp_path / "renamed", edit)
    acct = account(impl, planted)
    assert any("kv_up_proj" in p for p in acct.problems), acct.row(BASE.id)
    with pytest.raises(AssertionError, match="kv_up_proj") as info:
        settle_accounting(acct, known_for_accounting(impl, BASE), f"{impl} MLA weight accounting [planted]", repro)
    assert type(info.value) is AssertionError


@pytest.mark.meta
@pytest.mark.parametrize("impl", IMPLS)
def test_a_missing_mla_tensor_is_never_loaded(impl, drafts, tmp_path):
    def edit(w):
        del w["layers.0.self_attn.kv_a_layernorm.weight"]
    acct = account(impl, edited_copy(drafts.directory(impl, BASE), tmp_path / "missing", edit))
    assert acct.never_loaded == ["model.layers.0.self_attn.kv_a_layernorm.weight"], acct.row(BASE.id)


@pytest.mark.meta
@pytest.mark.parametrize("impl", IMPLS)
def test_a_reading_the_registry_does_not_state_fails(impl, drafts, repro):
    """vLLM's reading of the base case with one value planted otherwise: a difference no entry states fails, naming
    the key; and an entry for another reading of that key does not explain it."""
    adapter = ADAPTERS[impl]()
    directory = drafts.directory(impl, BASE)
    real = adapter.mla_checks.reading(directory)
    # the shims' MLA choice (shims.py point 3): vLLM's CPU_MLA whatever the host, not FLEX_ATTENTION
    assert real["attention_backend"] == "CPU_MLA", real["attention_backend"]
    seen = {**real, "kv_lora_rank": 17}
    found = adapter.mla_checks.differences(seen, read_config(directory))
    assert [k for k, _, _ in found] == ["kv_lora_rank"], found
    other = Known("reading", "planted-other-reading", impl, ">=0", "True", "x", key="kv_lora_rank", reads="16")
    for known in ((), (other,)):
        with pytest.raises(AssertionError, match="kv_lora_rank") as info:
            settle_readings(impl, found, known, f"{impl} MLA config reading [planted]", repro)
        assert type(info.value) is AssertionError


@pytest.mark.meta
@pytest.mark.parametrize("impl", IMPLS)
def test_a_rope_table_off_by_yarns_mscale_fails(impl, drafts):
    """The rope table check can fail: vLLM's table for the yarn case, scaled once more by yarn's mscale (0.1 ln 4 + 1,
    the scale a reader applying mscale twice would give), diverges; as read, it conforms."""
    import math

    case = CASES_BY_ID["mla_rope_yarn"]
    adapter, positions = ADAPTERS[impl](), rope_positions(drafts, case)
    seen = adapter.mla_checks.reading(drafts.directory(impl, case), positions)
    cfg = read_config(drafts.directory(impl, case))
    assert not any(r.failed for r in adapter.mla_checks.rope_against_reference(seen, cfg, positions))
    planted = {**seen, "cos": seen["cos"] * (0.1 * math.log(4.0) + 1.0)}
    cos, sin = adapter.mla_checks.rope_against_reference(planted, cfg, positions)
    assert cos.failed and not sin.failed, (cos, sin)


@pytest.mark.parametrize("impl", IMPLS)
def test_running_an_mla_draft_says_why_it_does_not_run(impl, drafts):
    """Asked to run an MLA draft, the adapter refuses in one line naming the compiled op (its forward_not_run)."""
    with pytest.raises(NotImplementedError, match="mla_decode_kvcache.*cpu_mla.py:180"):
        ADAPTERS[impl]().load(drafts.directory(impl, BASE), torch.float32)
