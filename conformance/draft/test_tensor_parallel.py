"""The draft forward at tensor parallelism 2 on CPU, through the default server's own distributed code: its
target and draft sharded over two gloo ranks (a process each), against TP 1 and the reference (ranks.py).

Heavy (three processes import the server, about 2-3 minutes on the 2-core host): marked `engine_full`, run by
`make engine-full`, never by `make test`. The draft is the trained tiny draft with its embedding moved off
the target's (seeded), so that a rank taking the target's embedding is a different drafter.
"""
from __future__ import annotations

import pytest
import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER, REFERENCE
from conformance.core.compare import compare_traces
from conformance.draft import ranks as R
from fixtures.checkpoint import edited_copy
from reference.eagle3 import DraftBatch

pytestmark = pytest.mark.engine_full

TP = ADAPTERS[DEFAULT_SERVER].tensor_parallel
STEPS = 3
SEQ, FIRST, EVERY, ROUNDS = 3, 5, 4, 3      # round r drafts after held-out sequence SEQ's first FIRST + EVERY*r tokens
SCENARIOS = (None, *(TP.RankFault(1, kind) for kind in TP.FAULTS))


@pytest.fixture(scope="module")
def tp_runs(trained_draft, tmp_path_factory):
    """(draft dirs by format, tp size -> per scenario its ranks' runs), served once for the module."""
    if TP is None:
        pytest.skip(f"{DEFAULT_SERVER} has no tensor-parallel runner here")
    root = tmp_path_factory.mktemp("tp")
    generator = torch.Generator().manual_seed(27)
    noise = 0.05 * torch.randn(trained_draft.config.vocab_size, trained_draft.config.hidden_size, generator=generator)

    def own_embedding(weights):
        weights["embed_tokens.weight"] = weights["embed_tokens.weight"] + noise

    formats = (ADAPTERS[DEFAULT_SERVER].checkpoint_format, ADAPTERS[REFERENCE].checkpoint_format)
    dirs = {fmt: edited_copy(trained_draft.checkpoints[fmt], root / fmt, own_embedding) for fmt in formats}
    heldout = trained_draft.heldout_ids[SEQ]
    contexts = [heldout[:FIRST + EVERY * r].tolist() for r in range(ROUNDS)]
    server = ADAPTERS[DEFAULT_SERVER]
    runs = TP.run_worlds(server, dirs[server.checkpoint_format], trained_draft.target_dir,
                         trained_draft.recipe.target_id, contexts, STEPS,
                         (1, 2), list(SCENARIOS), root / "ranks")
    return dirs, runs


def findings(tp_runs, scenario: int) -> list[str]:
    dirs, runs = tp_runs
    tp1, ranks = runs[1][scenario][0], runs[2][scenario]
    reference = ADAPTERS[REFERENCE]()
    ref32 = reference.load(dirs[ADAPTERS[REFERENCE].checkpoint_format], torch.float32)
    ref64 = reference.load(dirs[ADAPTERS[REFERENCE].checkpoint_format], torch.float64)

    def forward(r: int):
        rnd = tp1.rounds[r]
        n = len(rnd.context)
        batch = DraftBatch(aux=rnd.aux.double(), input_ids=torch.tensor(rnd.input_ids), positions=torch.arange(n),
                           seq_ids=torch.zeros(n, dtype=torch.long), next_ids=None)
        same = ref32.run(DraftBatch(**{**vars(batch), "aux": rnd.aux}), STEPS)
        return compare_traces(TP.gathered_trace(ranks, r), same, f"tp2-round{r}", precise=ref64.run(batch, STEPS))

    return R.report(ranks, tp1, TP.HEAD_SHARDED, forward)


def test_tp2_settings_are_sglangs_sharding(tp_runs):
    """What SGLang resolved on each rank: TP size 2, half the heads, the vocabularies split in rank order."""
    _, runs = tp_runs
    tp1, ranks = runs[1][0][0], runs[2][0]
    assert [r.settings["tp_rank"] for r in ranks] == [0, 1] and {r.settings["tp_size"] for r in ranks} == {2}
    for key in ("attention heads on this rank", "kv heads on this rank"):
        assert sum(r.settings[key] for r in ranks) == tp1.settings[key], (key, [r.settings for r in ranks])
    for key in ("embedding rows (target vocabulary)", "lm_head rows (draft vocabulary)"):
        spans = [r.settings[key] for r in ranks]
        assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == tp1.settings[key][1], (key, spans)


def test_tp2_ranks_agree_and_draft_what_tp1_drafts(tp_runs, repro):
    """Per rank: effective weights, aux states received, every replicated stage and the drafted tokens agree
    across ranks and with TP 1, and the ranks' gathered forward is the reference's in the fp32 tolerance."""
    lines = findings(tp_runs, 0)
    assert not lines, "sglang TP 2 vs TP 1 and the reference [fp32]:\n  " + "\n  ".join(lines) + f"\n  repro: {repro}"


EXPECTED = {   # the planted fault -> what the check must name first of its kind (rank, round, stage)
    "target_embedding": ("rank 1, stage `weight model.embed_tokens.weight`", "round 0, step 0, stage `embeds`"),
    "aux_ids_shifted": ("rank 1, round 0, step 0, stage `aux states received`",
                        "rank 1, round 0, step 0, stage `aux_in`"),
}


@pytest.mark.parametrize("scenario", range(1, len(SCENARIOS)), ids=[f.kind for f in SCENARIOS[1:]])
def test_planted_rank_fault_is_named(tp_runs, scenario):
    """Meta: a fault planted on rank 1 alone through SGLang's own mechanism fails the check above, naming
    the rank, the round and the stage (the TP 1 world has no rank 1: it stays clean)."""
    fault = SCENARIOS[scenario]
    lines = findings(tp_runs, scenario)
    assert lines, f"{fault.describe()}: not caught"
    for expected in EXPECTED[fault.kind]:
        assert any(expected in line for line in lines), f"{fault.describe()}: '{expected}' not named in:\n" + \
            "\n".join(lines)
