"""A user's MLA draft (draft_arch "mla": DeepSeek's latent attention, SGLang's `Eagle3DeepseekV2ForCausalLM`,
models/kimi_k25_eagle3.py) in the verdict: what of SGLang's MLA draft the user checks run, through the same machinery
as conformance/draft/test_mla_sglang.py (conformance/adapters/sglang/mla.py, weights.account_mla).

SGLang loads the user's directory as written (a copy: config.json copied, weights linked) when it is in SGLang's MLA
format, else this suite's conversion into it (NeMo's saved MLA draft: conformance/user/store.py
sglang_reads_as_written; the directory as written is then the verdict's first problem). Its load is accounted for
tensor by tensor (account_mla), judged with SGLang's MLA entries (mla.entries(): the registry's sglang-mla-*). Its
chain (step 0, then teacher-forced DECODE steps over its own MLA KV pool: the MLA column's LoadedMLA.run) is
compared with the reference draft's whole pass on the user's samples and aux states, stage by stage as the matrix
compares the column (compare_traces): every stage the column claims (mla.CLAIMED: the embedding, fc_norm and fc, the
attention's stages and its pool, the MLP, the hidden it returns, the logits, the drafted ids), so a divergence is
named at its own stage (rows SGLang computes only for each request's last token compared there).
"""
from __future__ import annotations

import gc

import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER, REFERENCE
from conformance.core import registry
from conformance.core.compare import Comparison, compare_traces
from conformance.core.tolerances import DTYPES
from conformance.core.trace import Trace
from reference.eagle3 import Eagle3Reference

IMPL = DEFAULT_SERVER   # SGLang: the server whose MLA draft class the user checks run
SERVER_MLA = ADAPTERS[IMPL].mla
MIN_TOKENS = 2   # mla_chain: a DECODE of each request's first token, an EXTEND of the rest


class LoadRefused(Exception):
    """SGLang did not build or load the MLA draft (its message: the loader's own words)."""


def is_mla(inputs) -> bool:
    return inputs is not None and inputs.config.draft_arch == "mla"


def known(case, areas=("accounting", "load")) -> tuple:
    """SGLang's MLA entries that apply to the user's draft. The registry's SGLang entries describe its Llama draft
    (llama_eagle3.py, llama.py), which an MLA draft never runs."""
    return registry.applicable(areas, IMPL, registry.case_names(case), SERVER_MLA.entries())


def account(store):
    """SGLang's MLA draft loaded from the directory the store gives it (the user's, or the conversion), accounted
    for."""
    return SERVER_MLA.account(store.directory(IMPL, store.case), store.plan.accounting)


def forward_comparison(store, dtype_name: str, steps: int) -> Comparison:
    """SGLang's MLA chain over `steps` steps in `dtype_name` against the reference, on the store's samples and aux
    states (the requests of MIN_TOKENS tokens or more), teacher-forced with the ids training's shift gives each
    request's last row (training_data.teacher_forced_ids), fed to both. SGLang's trace is its MLA column's
    (LoadedMLA.run: every stage the column claims), compared as the matrix compares it (compare_traces).
    LoadRefused: SGLang did not build or load it."""
    from conformance.checkpoints.training_data import make_data_batch

    cfg, dtype = store.inputs.config, DTYPES[dtype_name]
    used = [(s, a) for s, a in zip(store.samples, store.aux()) if len(s.input_ids) - 1 >= MIN_TOKENS]
    if not used:
        raise ValueError(f"no sample of {MIN_TOKENS + 1} tokens or more: SGLang's MLA chain needs {MIN_TOKENS} per "
                         "request (a DECODE of the first, an EXTEND of the rest)")
    samples, aux = zip(*used)
    batch = make_data_batch(cfg, list(samples), list(aux), steps)
    weights = store.weights()
    against = dtype if dtype == torch.float32 else store.precise   # AGAINST, or fp32 for a large draft (the plan)
    try:
        model = SERVER_MLA.load(store.directory(IMPL, store.case), dtype)
    except Exception as exc:   # SGLang's own refusal, in its words
        raise LoadRefused(f"{type(exc).__name__}: {exc}") from exc
    try:
        actual = SERVER_MLA.LoadedMLA(model, dtype).run(batch, steps)
    finally:
        # SGLang's model sits in reference cycles (its modules' hooks and back references): only a collection
        # frees it, and the fp32 reference built next is twice its size (the published Kimi-K2.5 MLA draft: 5.6 GB
        # of bf16 weights; without this the verdict passed a 19.8 GiB cap, with it it ends served as trained).
        del model
        gc.collect()
    # One reference at a time, each dropped once it has run: the trace alone is kept.
    expected = reference_trace(cfg, weights, against, batch, steps)
    # the reference in SGLang's dtype too: the error model's rho, as compare_with_reference gives it
    same = reference_trace(cfg, weights, dtype, batch, steps) if against != dtype else None
    case_id = store.case.id if steps == 1 else f"{store.case.id}_{steps}_steps"
    comparison = compare_traces(actual, expected, case_id, same=same)
    comparison.notes.insert(0, "SGLang's MLA draft (Eagle3DeepseekV2ForCausalLM) over its MLA KV pool: every stage "
                               "its MLA column claims (logits and later steps: each request's last row)")
    return comparison


def reference_trace(cfg, weights: dict[str, torch.Tensor], dtype: torch.dtype, batch, steps: int) -> Trace:
    """The reference draft's pass over `batch` in `dtype`, as a trace (every row, every stage)."""
    steps_seen = Eagle3Reference(cfg, weights, dtype).run(batch, steps)
    return Trace(impl=REFERENCE, dtype=dtype, steps=steps_seen, rows=[{} for _ in steps_seen],
                 claimed_stages=ADAPTERS[REFERENCE].claimed_stages, num_layers=cfg.num_hidden_layers)


def unobserved_readings(store, accounts: dict) -> list[str]:
    """The config keys a registered SGLang reading applies to on this draft that SGLang's MLA draft's accounting
    cannot show (its layer has no stage recorder: norm_before_residual, the window): not checked, never passed."""
    from conformance.user.readings import NOT_OBSERVED, names, observe

    acct = accounts.get(IMPL)
    if acct is None:
        return []
    entries = registry.applicable("reading", IMPL, names(store.inputs.checkpoint))
    return sorted({e.key for e in entries if observe(acct, e.key).startswith(NOT_OBSERVED)})
