"""Strict weight accounting, per implementation and case: every checkpoint tensor landed (bit-exact)
in a parameter, no parameter left unloaded, nothing dropped silently; plus the d2t/t2d invariants.
The planted tests show each kind of problem is caught and named.
"""
from __future__ import annotations


import pytest
import torch

from conformance.core.sections import Section
from conformance.loading.accounting import knob_rows, vocab_map_problems
from conformance.adapters import account
from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS, IMPLEMENTATIONS, cannot_express
from conformance.core.matching import known_param, settle_accounting
from conformance.core.registry import for_accounting
from fixtures.cases import CASES_BY_ID, STEP0_CASES
from conformance.checkpoints import INDEX_FILE, sha256, weight_files
from fixtures.checkpoint import edited_copy
from fixtures.tiny import make_config, make_vocab_map

pytestmark = pytest.mark.cpu
IMPLS = ("reference", *IMPLEMENTATIONS)   # the default lane's
VLLM = [impl for impl in ALL_IMPLEMENTATIONS if impl == "vllm"]   # its own lane (make vllm)
_ACCOUNTS: dict = {}


def account_of(drafts, case, impl):
    """One implementation's account of one case (fp32), computed once per session."""
    if (case.id, impl) not in _ACCOUNTS:
        _ACCOUNTS[case.id, impl] = account(impl, drafts.directory(impl, case))
    return _ACCOUNTS[case.id, impl]


def accounts_of(drafts, case, impls=IMPLS) -> dict:
    return {impl: account_of(drafts, case, impl) for impl in impls
            if cannot_express(impl, case.config) is None}


@pytest.mark.parametrize("case,impl", [known_param(case, impl, id=f"{case.id}-{impl}", known=for_accounting(impl, case))
                                       for case in STEP0_CASES for impl in ALL_IMPLEMENTATIONS
                                       if cannot_express(impl, case.config) is None])
def test_every_tensor_is_accounted_for(case, impl, drafts, report, repro):
    acct = account_of(drafts, case, impl)
    report.add_row(Section.WEIGHT_ACCOUNTING, acct.row(case.id))
    # The knobs that disagree, once per case and lane: an implementation of a lane of its own (vLLM) beside
    # the default lane's, so that its report shows the same draft in every implementation.
    own_lane = impl not in IMPLEMENTATIONS
    if impl == IMPLEMENTATIONS[0] or own_lane:
        impls = (*IMPLS, impl) if own_lane else IMPLS
        for row in knob_rows(case.id, list(accounts_of(drafts, case, impls).values()), only_disagreements=True):
            report.add_row(Section.EFFECTIVE_KNOBS, row)
    settle_accounting(acct, for_accounting(impl, case), f"{impl} weight accounting [{case.id}]", repro)


# ---------------------------------------------------------------- planted problems (harness self-tests)

def planted(drafts, case, fmt, tmp_path, edit):
    return edited_copy(drafts.checkpoint(case)[fmt], tmp_path / fmt, edit)


GQA = CASES_BY_ID["gqa"]


@pytest.mark.meta
def test_sglang_silent_drop_is_named(drafts, tmp_path):
    """An unknown tensor reaches no SGLang parameter (load_weights skips it, llama_eagle3.py:371-378)."""
    def edit(w):
        w["layers.0.self_attn.q_norm.weight"] = torch.ones(12)
    acct = account("sglang", planted(drafts, GQA, "sglang", tmp_path, edit))
    assert acct.dropped == ["layers.0.self_attn.q_norm.weight"]
    assert "dropped silently: layers.0.self_attn.q_norm.weight" in acct.problems


@pytest.mark.meta
def test_sglang_parameter_never_loaded_is_named(drafts, tmp_path):
    def edit(w):
        del w["layers.0.post_attention_layernorm.weight"]
    acct = account("sglang", planted(drafts, GQA, "sglang", tmp_path, edit))
    assert acct.never_loaded == ["model.layers.0.post_attention_layernorm.weight"]


@pytest.mark.meta
@pytest.mark.parametrize("impl,d2t_lands_on", [("sglang", "hot_token_id (d2t + arange)"),
                                               *((impl, "draft_id_to_target_id") for impl in VLLM)])
def test_fused_shards_and_vocab_map_are_mapped_back(impl, d2t_lands_on, drafts):
    """The servers with fused layers (SGLang; vLLM in its own lane): q/k/v land in rows [0:nh*hd],
    [nh*hd:+nkv*hd], [..:+nkv*hd] of qkv_proj, gate/up in the halves of gate_up_proj (the rows the shard ids
    name); d2t where each server keeps it; t2d skipped by their own code."""
    cfg = GQA.config
    acct = account_of(drafts, GQA, impl)
    landed = dict(acct.landed)
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    assert landed["layers.0.self_attn.q_proj.weight"] == f"{qkv}[0:{q}]"
    assert landed["layers.0.self_attn.k_proj.weight"] == f"{qkv}[{q}:{q + kv}]"
    assert landed["layers.0.self_attn.v_proj.weight"] == f"{qkv}[{q + kv}:{q + 2 * kv}]"
    assert landed["layers.0.mlp.gate_proj.weight"] == f"{gate_up}[0:{inter}]"
    assert landed["layers.0.mlp.up_proj.weight"] == f"{gate_up}[{inter}:{2 * inter}]"
    assert landed["d2t"] == d2t_lands_on
    assert acct.ignored == ["t2d"] and not acct.problems, acct.row(GQA.id)


@pytest.mark.meta
@pytest.mark.parametrize("impl", VLLM)
def test_vllm_parameter_never_loaded_is_named(impl, drafts, tmp_path):
    """A parameter vLLM runs but no tensor filled is a problem; one it never runs (hidden_norm of layers >= 1)
    is not: the run that tells them apart is observed, so a used one is never excused."""
    def edit(w):
        del w["layers.0.post_attention_layernorm.weight"]
    acct = account(impl, planted(drafts, GQA, "speculators", tmp_path, edit))
    assert acct.never_loaded == ["model.layers.0.post_attention_layernorm.weight"], acct.row(GQA.id)
    assert "never loaded: model.layers.0.post_attention_layernorm.weight" in acct.problems


@pytest.mark.meta
@pytest.mark.parametrize("impl", VLLM)
def test_vllm_unknown_tensor_is_named(impl, drafts, tmp_path):
    """A tensor no vLLM parameter matches: its AutoWeightsLoader refuses the load, naming it."""
    def edit(w):
        w["layers.0.self_attn.q_norm.weight"] = torch.ones(12)
    acct = account(impl, planted(drafts, GQA, "speculators", tmp_path, edit))
    assert any("q_norm" in p for p in acct.problems), acct.row(GQA.id)


@pytest.mark.meta
@pytest.mark.parametrize("impl", ("reference", *ALL_IMPLEMENTATIONS))
def test_a_value_that_did_not_land_is_named(impl, drafts, tmp_path, monkeypatch):
    """Landing is verified by value: a loader that writes something else is caught."""
    from conformance.loading import accounting

    real = accounting._equal
    monkeypatch.setattr(accounting, "_equal", lambda p, t: real(p, t) and t.shape != (GQA.config.hidden_size,))
    acct = account(impl, drafts.checkpoint(GQA)[ADAPTERS[impl].checkpoint_format])
    assert acct.differs and all(p for p in acct.differs), acct.row("gqa")


@pytest.mark.meta
def test_speculators_refusal_is_named(drafts, tmp_path):
    def edit(w):
        w["fc.bias"] = torch.zeros(GQA.config.hidden_size)
    acct = account("speculators", planted(drafts, GQA, "speculators", tmp_path, edit))
    assert "fc.bias" in acct.refused and acct.problems[0].startswith("refused: ")


@pytest.mark.meta
@pytest.mark.parametrize("impl", ["default lane", *VLLM])
def test_accounting_leaves_the_checkpoint_untouched(impl, drafts):
    dirs = drafts.checkpoint(CASES_BY_ID["fc_norm"])
    def digests():   # every weight file of every format (NeMo's: a shard and its index)
        return {fmt: [sha256(f) for f in (*weight_files(d), d / INDEX_FILE) if f.is_file()] for fmt, d in dirs.items()}

    before = digests()
    for name in IMPLS if impl == "default lane" else (impl,):
        account(name, dirs[ADAPTERS[name].checkpoint_format])
    assert before == digests()


# ---------------------------------------------------------------- d2t / t2d

def vocab(V=97, Vd=61, seed=0):
    cfg = make_config(vocab_size=V, draft_vocab_size=Vd)
    d2t, t2d = make_vocab_map(cfg, torch.Generator().manual_seed(seed))
    return {"d2t": d2t, "t2d": t2d}


def broken(edit):
    t = vocab()
    edit(t)
    return vocab_map_problems(t, 97, 61)


@pytest.mark.meta
def test_valid_vocab_map_has_no_problems():
    assert vocab_map_problems(vocab(), 97, 61) == []
    assert vocab_map_problems({}, 97, 97) == []   # no map needed when the vocabularies are equal


@pytest.mark.meta
@pytest.mark.parametrize("edit,field,words", [
    (lambda t: t.pop("d2t"), "d2t", "missing although draft_vocab_size 61 < vocab_size 97"),
    (lambda t: t.pop("t2d"), "t2d", "missing"),
    (lambda t: t.update(d2t=torch.zeros(61, dtype=torch.int64)), "d2t", "all zero"),
    (lambda t: t["d2t"].__setitem__(slice(3, 5), t["d2t"][3:5].flip(0) + torch.tensor([1, -1])), "d2t",
     "not strictly increasing"),
    (lambda t: t.update(d2t=t["d2t"] + 1000), "d2t", "outside [0, 97)"),
    (lambda t: t.update(d2t=t["d2t"].int()), "d2t", "dtype int32, expected int64"),
    (lambda t: t.update(d2t=t["d2t"][:-1]), "d2t", "shape (60,), expected (61,)"),
    (lambda t: t.update(t2d=t["t2d"].roll(1)), "t2d", "disagrees with d2t"),
    (lambda t: t.update(t2d=t["t2d"].long()), "t2d", "dtype int64, expected bool"),
    (lambda t: t.update(t2d=torch.ones(97, dtype=torch.bool)), "t2d", "97 True entries, expected draft_vocab_size 61"),
], ids=["no_d2t", "no_t2d", "all_zero_d2t", "swapped_d2t", "out_of_range", "int32_d2t", "short_d2t", "t2d_disagrees",
        "t2d_not_bool", "t2d_all_true"])
def test_broken_vocab_map_is_named(edit, field, words):
    problems = broken(edit)
    assert problems, "not caught"
    assert problems[0][0] == field and words in problems[0][1], problems


@pytest.mark.meta
def test_broken_vocab_map_in_a_checkpoint_is_named(drafts, tmp_path):
    def edit(w):
        w["d2t"] = torch.zeros_like(w["d2t"])
    acct = account("sglang", planted(drafts, GQA, "sglang", tmp_path, edit))
    assert any(p.startswith("invalid d2t: all zero") for p in acct.problems), acct.problems
    assert acct.row("gqa")["d2t/t2d invariants"] == "broken"
