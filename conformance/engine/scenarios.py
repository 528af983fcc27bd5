"""The engine lane's scenarios, grouped by the engine (server arguments) that serves them.

An engine start costs 10-60 s on the 2-core host (the spawned scheduler imports SGLang), generation
a few seconds per request: scenarios that can share server arguments share an engine. Prompts are
held-out sequences of the trained draft's fixture (two random tokens, then the target's own greedy
continuation), so a prompt of any length stays on text the draft was trained for.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    seq: int        # held-out sequence
    length: int     # its first `length` tokens


@dataclass(frozen=True)
class Scenario:
    id: str
    summary: str
    waves: tuple[tuple[Prompt, ...], ...]   # each wave submitted together, after the previous one finished
    new_tokens: int = 16

    @property
    def prompts(self) -> list[Prompt]:
        return [p for wave in self.waves for p in wave]


@dataclass(frozen=True)
class EngineGroup:
    id: str
    steps: int                              # --speculative-num-steps
    topk: int                               # --speculative-eagle-topk
    draft_tokens: int                       # --speculative-num-draft-tokens (as requested)
    scenarios: tuple[Scenario, ...]
    chunked_prefill_size: int | None = None
    tp_size: int = 1                                # --tp-size: ranks, a scheduler process each
    page_size: int = 1                              # --page-size: KV tokens per page (paged KV, radix per page)
    dtype: str = "float32"                          # --dtype: the lane's default; another is passed to SGLang
    env: dict = field(default_factory=dict)         # SGLang's own debug switches (planted faults)
    fault_yaml: str | None = None                   # a source_patcher config (planted faults)
    max_total_tokens: int | None = None             # --max-total-tokens: the KV pool's tokens (None: the lane's)
    draft_layers: int = 1                           # the trained draft's decoder layers (a lane of its own when > 1)

    def server_args(self) -> dict:
        args = dict(speculative_num_steps=self.steps, speculative_eagle_topk=self.topk,
                    speculative_num_draft_tokens=self.draft_tokens)
        if self.chunked_prefill_size:
            args["chunked_prefill_size"] = self.chunked_prefill_size
        if self.tp_size > 1:
            args["tp_size"] = self.tp_size
        if self.page_size > 1:
            args["page_size"] = self.page_size
        if self.dtype != "float32":
            args["dtype"] = self.dtype
        if self.max_total_tokens:
            args["max_total_tokens"] = self.max_total_tokens
        return args

    @property
    def chain(self) -> bool:
        return self.topk == 1


def _two(first: int) -> tuple[tuple[Prompt, ...], ...]:
    return ((Prompt(first, 2), Prompt(first + 1, 4)),)


GROUPS = (
    # The flags the project started from: SGLang serves a chain of 1 step and overrides the 16 draft tokens.
    EngineGroup("seed_flags", steps=1, topk=1, draft_tokens=16, scenarios=(
        Scenario("seed_flags", "topk 1, steps 1, draft tokens 16: the accept length SGLang measures", _two(0)),)),
    EngineGroup("chain_k2_chunked", steps=2, topk=1, draft_tokens=3, chunked_prefill_size=4, scenarios=(
        Scenario("chunked_prefill", "chunked prefill of 4 tokens: prompts of 11 and 6 tokens split mid-way",
                 ((Prompt(2, 11), Prompt(3, 6)),), new_tokens=12),)),
    EngineGroup("chain_k3", steps=3, topk=1, draft_tokens=4, scenarios=(
        Scenario("batch", "three requests of 2, 5 and 9 tokens in one batch",
                 ((Prompt(4, 2), Prompt(5, 5), Prompt(6, 9)),)),
        Scenario("radix_hit", "a cold request, then the same prompt again (a full radix hit) and a prompt that "
                 "extends it (a shared prefix)", ((Prompt(7, 6),), (Prompt(7, 6), Prompt(7, 14)))),
    )),
    EngineGroup("chain_k4", steps=4, topk=1, draft_tokens=5, scenarios=(
        Scenario("chain_k4", "chain of 4 draft steps", _two(8)),)),
    EngineGroup("chain_k5", steps=5, topk=1, draft_tokens=6, scenarios=(
        Scenario("chain_k5", "chain of 5 draft steps", _two(10)),)),
    EngineGroup("tree_k2_s3", steps=3, topk=2, draft_tokens=6, scenarios=(
        Scenario("tree_k2_s3", "tree of topk 2, 3 steps, 6 draft tokens", _two(12)),)),
)
# The heavy groups (`make engine-full`, marker engine_full; never `make test`): tensor parallelism 2, each rank
# a scheduler process of its own over gloo (start about 2.5 min on the 2-core host), paged KV, a 2-layer draft (a
# draft of its own to train, a few minutes once) and a KV pool small enough that the radix cache evicts.
# Paged KV (page size 16, the Triton backend's paged path): the batch at page 1's prompts, and a request whose
# prompt and drafts cross page boundaries, served again with a longer one (the radix cache matches whole pages only).
FULL_GROUPS = (
    EngineGroup("chain_k3_tp2", steps=3, topk=1, draft_tokens=4, tp_size=2, scenarios=(
        Scenario("batch_tp2", "TP 2 (two gloo ranks): three requests of 2, 5 and 9 tokens in one batch",
                 ((Prompt(4, 2), Prompt(5, 5), Prompt(6, 9)),)),)),
    EngineGroup("chain_k3_page16", steps=3, topk=1, draft_tokens=4, page_size=16, scenarios=(
        Scenario("batch_page16", "page size 16: three requests of 2, 5 and 9 tokens in one batch",
                 ((Prompt(4, 2), Prompt(5, 5), Prompt(6, 9)),)),
        Scenario("pages_page16", "page size 16: a prompt of 18 tokens drafting across pages, then it again and "
                 "one of 35 tokens that shares its first page (a radix hit of one whole page)",
                 ((Prompt(7, 18),), (Prompt(7, 18), Prompt(7, 35))), new_tokens=20),
    )),
    # The trained draft in two decoder layers (Recipe draft_layers=2, speculators' own training), served through
    # whichever speculative worker SGLang's scheduler builds for it.
    EngineGroup("chain_k3_two_layers", steps=3, topk=1, draft_tokens=4, draft_layers=2, scenarios=(
        Scenario("two_layers", "a 2-layer trained draft, chain of 3: three requests of 2, 5 and 9 tokens in one batch",
                 ((Prompt(4, 2), Prompt(5, 5), Prompt(6, 9)),)),)),
    # A KV pool of 96 tokens. A 12-token request leaves its prompt and its output in the radix cache as two nodes
    # (27 tokens of KV). A 60-token request then needs more than the 69 tokens left (75, besides its drafts' slots):
    # SGLang evicts the least recently used leaf, the first request's output, and its prompt still hits. A second
    # 60-token request needs nearly the whole pool: the first prompt's node goes too. Served again, the second
    # 60-token prompt comes first and hits whole (its node locked while it runs); the first prompt, after it, misses.
    EngineGroup("chain_k3_small_pool", steps=3, topk=1, draft_tokens=4, max_total_tokens=96, scenarios=(
        Scenario("radix_evict", "a KV pool of 96 tokens: a 12-token prompt, then two of 60 tokens in turn that evict "
                 "it from the radix cache, then the last of them again (a whole hit) and the first (a miss)",
                 ((Prompt(20, 12),), (Prompt(21, 60),), (Prompt(22, 60),), (Prompt(22, 60), Prompt(20, 12)))),)),
)
# bf16 (`make engine-full`, conformance/engine/test_engine_bf16.py): the batch prompts at K = 3 served in bfloat16,
# held stage by stage under the bf16 error model (conformance/engine/bf16.py), not to the fp32 oracle above.
BF16_GROUPS = (
    EngineGroup("chain_k3_bf16", steps=3, topk=1, draft_tokens=4, dtype="bfloat16", scenarios=(
        Scenario("batch_bf16", "bf16: three requests of 2, 5 and 9 tokens in one batch",
                 ((Prompt(4, 2), Prompt(5, 5), Prompt(6, 9)),)),)),
)
# The scenario at the same prompts and flags in the default configuration (TP 1, page size 1): every round's
# drafted tokens must be identical.
TWINS = {"batch_tp2": "batch", "batch_page16": "batch"}
# An MLA draft (DeepSeek's latent attention, the layout Kimi-K2.5/K2.6 drafts are served with) for a tiny DeepSeek-V3
# target, trained by NeMo Automodel's own training code (acceptance/trained_draft.py MLA_RECIPE), served by
# SGLang's Eagle3DeepseekV2ForCausalLM: two requests in one batch, a chain of 3.
MLA_GROUPS = (
    EngineGroup("mla_chain_k3", steps=3, topk=1, draft_tokens=4, chunked_prefill_size=4, scenarios=(
        Scenario("mla_batch", "an MLA draft (NeMo-trained) for a DeepSeek-V3 target: requests of 3 and 6 tokens in "
                 "one batch, chain of 3, a chunked prefill of 4 tokens (the 6-token prompt split: the draft extends "
                 "over its cached latents)", ((Prompt(4, 3), Prompt(5, 6)),), new_tokens=12),)),
)
SCENARIOS = {s.id: (g, s) for g in GROUPS + FULL_GROUPS + BF16_GROUPS + MLA_GROUPS for s in g.scenarios}
