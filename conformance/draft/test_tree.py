"""Tree drafting (topk > 1): SGLang's EAGLE tree draft vs the reference tree (reference/tree.py), fp32.

SGLang drafts through its own helpers (LoadedSGLang.run_tree): draft EXTEND, then steps - 1
draft-decode passes over batch*topk rows. Every draft step is compared stage by stage, then the
candidates its rows propose, the ones expanded, and finally the tree handed to verification.

SGLang 0.5.23's tree draft, as found (paths under sglang/srt/):
1. Depth 1: topk of softmax(draft-extend logits) at each request's last token
   (speculative/eagle_worker_v2.py:1071-1085), mapped to target ids through hot_token_id
   (eagle_worker_v2.py:757-758); all are expanded, each fed the root's hidden (speculative/spec_utils.py:417-435).
2. Draft-decode pass i (eagle_worker_v2.py:808-899) embeds the tree rows' tokens at position
   seq_len + i (speculative/eagle_worker_common.py:357-361, eagle_worker_v2.py:888), fed the hidden of
   each row's parent, and each row proposes the topk of its softmax (eagle_worker_v2.py:881-898).
3. Scores are products of probabilities, row score times child probability (spec_utils.py:448); the
   topk best of the topk*topk children are expanded, new row r taking the hidden of parent row
   pick // topk (spec_utils.py:451-464). Same ranking as EAGLE's summed log-probabilities; compared as logs.
4. KV: row b*topk+r writes pass i's keys into column r's slot i (the request's topk*steps slots after
   its prefix, laid out (topk, steps): eagle_worker_common.py:263-300, kernels/ops/speculative/
   cache_locs.py:43-82, speculative/eagle_utils.py:57-78) and reads the prefix plus column r's slots
   0..i (cache_locs.py:262-268 via layers/attention/triton_backend.py:2595 and flashinfer_backend.py:2553;
   flashattention_backend.py:986-991; the CPU backend's expanded req_to_token, intel_amx_backend.py:461-487).
   Column r holds whatever nodes held row r before, not row r's ancestors once a reselection moved
   its parent to another row; EAGLE's tree mask follows the parent. So SGLang leaves the exact tree at
   draft step 2, the first pass after a reselection, at layers.0.attn_core; with 2 steps it cannot.
   The reference tree given this layout as its attention rule (drafting.py row_slot_kv) matches SGLang.
5. organize_draft_results (eagle_utils.py:100-135): the num_draft_tokens - 1 best scores over all
   candidates, their ids ascending, their tokens, and the expanded nodes as the parents list.
The KV layout of 4 is filled by the adapter (draft_kv_layout): SGLang's Triton and sgl_kernel code
that builds it does not run on this host; it is checked against SGLang's Triton kernels run in Triton's
interpreter. SGLang's torch.compile'd helper runs eagerly (adapters/sglang/drafting.py eager_tree_helpers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

from conformance.core import stages
from conformance.adapters import ADAPTERS
from conformance.core.trace import Trace
from conformance.adapters.sglang.drafting import draft_kv_layout, eager_tree_helpers, row_slot_kv
from conformance.core.compare import Comparison, compare_traces, compare_tensors
from conformance.core.matching import known_param, match_forward, settle
from conformance.core.sections import Section
from conformance.draft.tree_cases import TREE_CASES, TreeCase, known_tree
from fixtures.cases import CASES_BY_ID
from reference.tree import Attends, ancestors, draft_tree

DTYPE = torch.float32


def make_tree_params(cases, divergent_marks: bool):
    """One param per case; with `divergent_marks`, a registered tree divergence makes it a strict xfail."""
    for case in cases:
        yield known_param(case, id=case.id, known=known_tree(case) if divergent_marks else ())


@pytest.fixture(scope="module")
def sglang_trees(drafts):
    """SGLang's tree draft per case, run once (a loaded SGLang draft per draft case)."""
    loaded, trees = {}, {}

    def tree(case: TreeCase) -> Trace:
        if case.id not in trees:
            draft = CASES_BY_ID[case.draft]
            if draft.id not in loaded:
                loaded[draft.id] = ADAPTERS["sglang"]().load(drafts.checkpoint(draft)["sglang"], DTYPE)
            batch = drafts.batch(draft, 1)
            trees[case.id] = loaded[draft.id].run_tree(batch, case.steps, case.topk, case.num_draft_tokens)
        return trees[case.id]
    return tree


def make_reference_tree(drafts, case: TreeCase, attends: Attends = ancestors) -> Trace:
    """The reference tree of `case`; with `attends` row_slot_kv, the reference given SGLang's KV layout."""
    draft = CASES_BY_ID[case.draft]
    ref = ADAPTERS["reference"]().load(drafts.checkpoint(draft)["speculators"], DTYPE).model
    steps = draft_tree(ref, drafts.batch(draft, 1), case.steps, case.topk, case.num_draft_tokens, attends)
    name = "reference tree" if attends is ancestors else "reference tree with SGLang's row-slot KV"
    return Trace(impl=name, dtype=DTYPE, steps=steps, rows=[{} for _ in steps],
                 claimed_stages=ADAPTERS["reference"].claimed_stages, num_layers=draft.config.num_hidden_layers)


def compare_tree(actual: Trace, expected: Trace, case: TreeCase) -> Comparison:
    """Every step: its canonical stages in forward order, then its candidates and selection; the
    tree after the last step."""
    cmp = compare_traces(actual, expected, f"{case.id} on {case.draft}")
    results = []
    for step in range(case.steps):
        results += [r for r in cmp.results if r.step == step]
        tree_stages = stages.TREE + (stages.TREE_FINAL if step == case.steps - 1 else ())
        results += [compare_tensors(step, name, actual.steps[step][name], expected.steps[step][name], DTYPE)
                    for name in tree_stages]
    cmp.results = results
    return cmp


def record_tree_row(report, case: TreeCase, cmp: Comparison, outcome: str) -> None:
    first = cmp.first_divergence
    measured = [r for r in cmp.results if r.max_abs is not None and stages.stage_kind(r.stage) != "ids"]
    worst = first if first is not None else max(measured, key=lambda r: r.max_abs)
    report.add_row(Section.TREE, {
        "case": case.id, "draft": case.draft, "topk": case.topk, "steps": case.steps,
        "draft tokens": case.num_draft_tokens, "against": cmp.against, "outcome": outcome,
        "first divergence": "conforms" if first is None else f"step {first.step} `{first.stage}`",
        "max abs": worst.max_abs, "max rel": worst.max_rel,
        "at": f"step {worst.step} `{worst.stage}`"})


@pytest.mark.cpu
@pytest.mark.parametrize("case", list(make_tree_params(TREE_CASES, divergent_marks=True)))
def test_multistep_tree_matches_exact_tree(case, drafts, sglang_trees, report, repro):
    """SGLang's tree vs the exact tree: every node attends to the prefix, its ancestors and itself."""
    cmp = compare_tree(sglang_trees(case), make_reference_tree(drafts, case), case)
    first = cmp.first_divergence
    hit = match_forward(known_tree(case), first, CASES_BY_ID[case.draft].config.num_hidden_layers)
    record_tree_row(report, case, cmp, "pass" if first is None else ("known divergence" if hit else "FAIL"))
    if first is not None:
        settle(cmp.message(repro), hit)


@pytest.mark.cpu
@pytest.mark.parametrize("case", list(make_tree_params([c for c in TREE_CASES if known_tree(c)], False)))
def test_multistep_tree_row_slot_kv_explains_the_divergence(case, drafts, sglang_trees, report, repro):
    """For every case with the registered tree divergence: the reference with SGLang's KV layout (row r
    reads column r) matches SGLang at every step and stage: that layout is the whole difference."""
    cmp = compare_tree(sglang_trees(case), make_reference_tree(drafts, case, row_slot_kv), case)
    record_tree_row(report, case, cmp, "pass" if cmp.first_divergence is None else "FAIL")
    assert cmp.first_divergence is None, cmp.message(repro)


def eager_and_traced(compiled, args) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors a torch.compile'd function returns inside eager_tree_helpers(), and those torch.compile makes
    of the same function: the graph dynamo captures, run by the aot_eager backend (inductor's C++ build would
    take 17-34 s here). A body that computes otherwise when compiled (e.g. a branch on is_compiling()) differs."""
    with eager_tree_helpers():
        eager = compiled(*args)
    traced = torch.compile(compiled.__wrapped__, dynamic=True, backend="aot_eager")(*args)
    return tree_leaves(eager), tree_leaves(traced)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.cpu
@pytest.mark.meta
def test_tree_helpers_run_eagerly_only_in_scope():
    """eager_tree_helpers() is needed (SGLang's helper is torch.compile'd), computes what compiling that helper
    computes, and leaves torch.compile alone outside its scope."""
    from sglang.srt.speculative import spec_utils

    compiled = spec_utils._select_top_k_tokens_later
    assert hasattr(compiled, "__wrapped__"), "SGLang no longer compiles its tree helper: drop eager_tree_helpers"
    g = torch.Generator().manual_seed(0)
    B, k = 3, 2
    args = (1, torch.rand(B * k, k, generator=g), torch.randint(0, 50, (B * k, k), generator=g),
            torch.randn(B * k, 5, generator=g), torch.rand(B, k, generator=g), k)
    eager, traced = eager_and_traced(compiled, args)   # ids, hidden, scores, then the tree info
    assert same(eager, traced), "SGLang's tree helper run eagerly differs from the helper compiled"

    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    f = torch.compile(lambda x: x + 1, backend=counting_backend)
    with eager_tree_helpers():
        f(torch.ones(2))
    assert not compiles, "torch.compile ran inside eager_tree_helpers()"
    f(torch.ones(2))
    assert compiles, "eager_tree_helpers() left torch.compile disabled after its scope"


@pytest.mark.cpu
@pytest.mark.meta
def test_eager_vs_compiled_check_catches_a_helper_that_computes_otherwise_when_compiled():
    """The check above can fail: a planted compiled helper whose body takes another branch under torch.compile."""
    @torch.compile(dynamic=True)
    def planted(x):
        return x + 1 if torch.compiler.is_compiling() else x

    eager, traced = eager_and_traced(planted, (torch.ones(2),))
    assert not same(eager, traced) and torch.equal(traced[0], eager[0] + 1), (eager, traced)


# SGLang's own Triton kernels for the draft's KV layout, run by Triton's CPU interpreter in a fresh
# process (TRITON_INTERPRET must be set before the kernels are defined), called as prepare_for_draft
# (eagle_worker_common.py:290-299) and TritonMultiStepDraftBackend.common_template
# (layers/attention/triton_backend.py:2595-2616) call them, page size 1.
KERNEL_SCRIPT = """
import json, sys, torch
from sglang.kernels.ops.speculative.cache_locs import (
    assign_draft_cache_locs_contiguous, generate_draft_decode_kv_indices)
from sglang.srt.utils import next_power_of_2
job = json.load(sys.stdin)
req_to_token, topk, steps = torch.tensor(job["req_to_token"], dtype=torch.int32), job["topk"], job["steps"]
seq_lens = torch.tensor(job["lengths"])
bs, pool_len = seq_lens.numel(), req_to_token.shape[1]
req_pool_indices = torch.arange(1, bs + 1)
out_cache_loc = torch.zeros(bs * topk * steps, dtype=torch.int64)
assign_draft_cache_locs_contiguous[(bs,)](
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, steps)
kv_indices = torch.zeros(steps, bs * topk * pool_len, dtype=torch.int64)
kv_indptr = torch.zeros(steps, bs * topk + 1, dtype=torch.int32)
positions = seq_lens.repeat_interleave(topk)
generate_draft_decode_kv_indices[(steps, bs, topk)](
    req_pool_indices, req_to_token, seq_lens, kv_indices, kv_indptr, positions, pool_len, kv_indices.shape[1],
    kv_indptr.shape[1], next_power_of_2(bs), next_power_of_2(steps), next_power_of_2(bs * topk), 1)
reads = [[kv_indices[i, kv_indptr[i, j]:kv_indptr[i, j + 1]].tolist() for j in range(bs * topk)]
         for i in range(steps - 1)]
print(json.dumps({"out_cache_loc": out_cache_loc.tolist(), "reads": reads}))
"""


@pytest.mark.cpu
@pytest.mark.meta
def test_tree_kv_layout_is_sglangs_kernels():
    """draft_kv_layout (what run_tree writes and reads) equals what SGLang's Triton kernels compute."""
    lengths, topk, steps = [9, 4, 12], 3, 4
    width = max(lengths) + topk * steps
    req_to_token = torch.zeros(len(lengths) + 1, width, dtype=torch.int32)   # row 0 and slot 0 pad, as _pools
    slots, base = [], 1
    for r, n in enumerate(lengths):
        slots.append(torch.arange(base, base + n + topk * steps))
        req_to_token[r + 1, :slots[-1].numel()] = slots[-1].to(torch.int32)
        base += slots[-1].numel()
    job = {"req_to_token": req_to_token.tolist(), "lengths": lengths, "topk": topk, "steps": steps}
    done = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], input=json.dumps(job), capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, f"SGLang's kernels in Triton's interpreter failed:\n{done.stderr[-3000:]}"
    kernels = json.loads(done.stdout.strip().splitlines()[-1])

    out_cache_loc, rows = draft_kv_layout(slots, lengths, topk, steps)
    assert out_cache_loc.tolist() == kernels["out_cache_loc"], (
        "draft write slots differ from assign_draft_cache_locs_contiguous")
    for i, reads in enumerate(kernels["reads"]):
        for j, read in enumerate(reads):
            n = lengths[j // topk]
            assert rows[j][:n + i + 1].tolist() == read, (
                f"draft pass {i}, tree row {j}: adapter reads {rows[j][:n + i + 1].tolist()}, "
                f"generate_draft_decode_kv_indices {read}")
