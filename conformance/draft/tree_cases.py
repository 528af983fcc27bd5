"""The tree-drafting cases (topk > 1; conformance/draft/test_tree.py) and the registry entries that apply."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from conformance.adapters import DEFAULT_SERVER
from conformance.core.registry import Known, applicable
from fixtures.cases import CASES_BY_ID


@dataclass(frozen=True)
class TreeCase:
    id: str
    draft: str               # the DraftCase (fixtures/cases.py) whose checkpoint and batch are drafted from
    topk: int                # --speculative-eagle-topk
    steps: int               # --speculative-num-steps
    num_draft_tokens: int    # --speculative-num-draft-tokens

    def names(self) -> dict[str, object]:
        """What a registry tree condition reads: the draft's knobs and the tree's shape."""
        return {**dataclasses.asdict(CASES_BY_ID[self.draft].config), "topk": self.topk, "steps": self.steps,
                "num_draft_tokens": self.num_draft_tokens}


TREE_CASES = (
    TreeCase("tree_k2_s2", "ms_gqa", topk=2, steps=2, num_draft_tokens=4),
    TreeCase("tree_k4_s2", "ms_gqa", topk=4, steps=2, num_draft_tokens=12),
    TreeCase("tree_k2_s3", "ms_gqa", topk=2, steps=3, num_draft_tokens=7),
    TreeCase("tree_k4_s5", "ms_gqa", topk=4, steps=5, num_draft_tokens=21),
    TreeCase("tree_k2_s4_norm_output", "ms_norm_output", topk=2, steps=4, num_draft_tokens=8),
)


def known_tree(case: TreeCase) -> tuple[Known, ...]:
    """The registry's tree entries for SGLang's tree draft (the default server's) of this case (within its steps)."""
    return tuple(e for e in applicable("tree", DEFAULT_SERVER, case.names()) if e.step < case.steps)
