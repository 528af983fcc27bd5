"""The real published configs (fixtures/data/real-configs): every one parses, its knobs survive every
format, and its tiny random twin (same knobs, tiny sizes) runs step 0 through every adapter that
supports them, against the reference. A config the reference cannot run is named with its field.
"""
from __future__ import annotations

import json

import pytest

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.session.harness import assert_conforms, conformance_params
from conformance.checkpoints import (WRITABLE, CheckpointError, ConversionError, config_json, parse_config,
                                    read_config_file, read_target_config)
from fixtures.real_configs import (NOT_A_DRAFT, draft_config_files, file_id, real_twin_cases, shrink,
                                   target_config_files)

pytestmark = pytest.mark.cpu
DRAFTS = draft_config_files()
TWINS = real_twin_cases()


def raw_layer(raw: dict) -> dict:
    return raw.get("transformer_layer_config") or raw


def test_real_configs_are_there():
    assert len(DRAFTS) >= 29 and len(target_config_files()) >= 9, "fixtures/data/real-configs is missing files"


@pytest.mark.meta
@pytest.mark.parametrize("path", DRAFTS, ids=file_id)
def test_real_draft_config_parses(path):
    """Parses into training-semantics knobs that agree with the file; what the reference cannot run
    (or no implementation can: contradictory knobs) is named by its field, on one line."""
    raw = json.loads(path.read_text())
    if path.name in NOT_A_DRAFT:
        refused = "field architectures: DeepseekV3ForCausalLMNextN is not an EAGLE-3 draft"
        with pytest.raises(CheckpointError, match=refused):
            read_config_file(path)
        return
    parsed = read_config_file(path)
    knobs, layer = parsed.knobs, raw_layer(raw)
    assert knobs["hidden_size"] == layer["hidden_size"]
    assert knobs["num_attention_heads"] == layer["num_attention_heads"]
    assert knobs["intermediate_size"] == layer["intermediate_size"]
    assert knobs["head_dim"] == layer.get("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    assert {knobs["vocab_size"], knobs["draft_vocab_size"]} == \
        {v for v in (layer.get("vocab_size"), raw.get("draft_vocab_size"), raw.get("target_vocab_size")) if v}
    for field, problem in parsed.problems:
        assert field.startswith("field ") and problem and "\n" not in problem
    if parsed.runnable:
        parsed.config(path)
    else:
        with pytest.raises(CheckpointError, match=parsed.problems[0][0]):
            parsed.config(path)


@pytest.mark.meta
@pytest.mark.parametrize("path", [p for p in DRAFTS if p.name not in NOT_A_DRAFT and read_config_file(p).runnable],
                         ids=file_id)
def test_real_config_knobs_survive_every_format(path, tmp_path):
    cfg = read_config_file(path).config(path)
    for fmt in WRITABLE:
        try:
            raw = config_json(cfg, fmt)
        except ConversionError as exc:   # a knob the format cannot express is named, never dropped
            # sglang-mla is SGLang's MLA draft class only: every other decoder layer is refused by name
            assert (fmt in ("specforge", "nemo") or (fmt == "sglang-mla" and cfg.draft_arch != "mla")) \
                and "cannot express" in str(exc), f"{fmt}: {exc}"
            continue
        assert parse_config(raw, tmp_path / "config.json", fmt).config() == cfg, f"{fmt} lost a knob"


@pytest.mark.meta
@pytest.mark.parametrize("path", target_config_files(), ids=file_id)
def test_real_target_config_parses(path):
    target = read_target_config(path)
    raw = json.loads(path.read_text())
    text = raw if "hidden_size" in raw else raw["text_config"]
    assert (target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]) == \
        (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"])


@pytest.mark.meta
@pytest.mark.parametrize("case", TWINS, ids=lambda c: c.id)
def test_twin_keeps_the_knobs(case):
    """Everything but the sizes is the real config's; the size relations (MHA/GQA/MQA, head_dim vs
    H / heads, Ht vs H, Vd vs V) are kept."""
    path = next(p for p in DRAFTS if case.id == f"real_{file_id(p)}")
    real, twin = read_config_file(path).config(path), case.config
    for knob in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "tie_word_embeddings",
                 "attention_bias", "mlp_bias", "hidden_act", "aux_layer_ids", "num_aux_hidden_states",
                 "rope_theta", "rope_scaling", "rms_norm_eps", "num_hidden_layers"):
        assert getattr(twin, knob) == getattr(real, knob), knob
    def mha(c):
        return c.num_key_value_heads == c.num_attention_heads

    def explicit_head_dim(c):
        return c.head_dim * c.num_attention_heads == c.hidden_size

    assert mha(twin) == mha(real)
    assert (twin.num_key_value_heads == 1) == (real.num_key_value_heads == 1)
    assert explicit_head_dim(twin) == explicit_head_dim(real)
    assert (twin.target_hidden_size == twin.hidden_size) == (real.target_hidden_size == real.hidden_size)
    assert (twin.draft_vocab_size < twin.vocab_size) == (real.draft_vocab_size < real.vocab_size)
    assert (twin.sliding_window is None) == (real.sliding_window is None)
    assert shrink(real) == twin


def twin_params():
    """impl x twin for every twin whose knobs the implementation can express (its `unsupported`)."""
    for impl in IMPLEMENTATIONS:
        cases = [c for c in TWINS if ADAPTERS[impl]().unsupported(c.config) is None]
        yield from conformance_params([impl], ["fp32"], cases)


@pytest.mark.parametrize("impl,dtype_name,case", list(twin_params()))
def test_real_config_twin_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    assert_conforms(drafts, report, impl, case, dtype_name, request.node.nodeid, repro)
