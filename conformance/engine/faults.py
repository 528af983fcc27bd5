"""Serving faults planted through SGLang's own mechanisms, each in an engine of its own: the engine lane
must fail on each, its first divergence at the round, draft step and stage named here.

- SGLANG_DEBUG_REVERT_PR=25015: SGLang's switch that puts PR 25015's bug back (draft-decode positions
  advanced before the forward; srt/debug_utils/pr_fix_toggle.py);
- sglang.srt.debug_utils.source_patcher configs (the format SGLang's switch uses) on the worker's
  hand-off: the target's aux states captured from the wrong layers, and the recurrent hidden state fed
  back to the next round's first decode pass from the wrong row of the draft extend.
"""
from __future__ import annotations

from dataclasses import dataclass

from conformance.engine.scenarios import EngineGroup, Prompt, Scenario

# SGLang's capture takes layer i's input as the output of layer i - 1, hence its +1 (models/llama.py:939-941).
AUX_FROM_WRONG_LAYERS = """
patches:
  - target: sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture
    edits:
      - match: |
          self.model.layers_to_capture = [val + 1 for val in layer_ids]
        replacement: |
          self.model.layers_to_capture = [val for val in layer_ids]
"""

# The draft extend after verify computes every verify row; the worker keeps the last accepted one's
# hidden state for the next draft pass (speculative/eagle_worker_v2.py:1259-1262).
HIDDEN_FROM_WRONG_ROW = """
patches:
  - target: sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode
    edits:
      - match: |
          draft_logits_output.hidden_states = draft_logits_output.hidden_states[
              select_index
          ]
        replacement: |
          draft_logits_output.hidden_states = draft_logits_output.hidden_states[select_index - 1]
"""

# One request that the unfaulted lane serves too (chain_k3's batch scenario), with fewer new tokens.
FAULT_PROMPT = Prompt(4, 2)


@dataclass(frozen=True)
class PlantedFault:
    id: str
    summary: str
    group: EngineGroup
    round: int      # where the lane must first diverge
    step: int
    stage: str


def _group(fault_id: str, **planted) -> EngineGroup:
    scenario = Scenario(fault_id, f"planted fault {fault_id}", ((FAULT_PROMPT,),), new_tokens=10)
    return EngineGroup(fault_id, steps=3, topk=1, draft_tokens=4, scenarios=(scenario,), **planted)


FAULTS = (
    PlantedFault("revert_pr_25015", "SGLANG_DEBUG_REVERT_PR=25015: draft-decode positions advanced before the "
                 "forward (SGLang PR 25015's bug, put back by SGLang's own switch)",
                 _group("revert_pr_25015", env={"SGLANG_DEBUG_REVERT_PR": "25015"}), 0, 1, "positions"),
    PlantedFault("aux_from_wrong_layers", "the target captures each aux state one layer shallower (SGLang's +1 "
                 "dropped from set_eagle3_layers_to_capture)",
                 _group("aux_from_wrong_layers", fault_yaml=AUX_FROM_WRONG_LAYERS), 0, 0, "aux_in"),
    PlantedFault("hidden_from_wrong_row", "the draft extend after verify hands the next round the hidden state "
                 "of the row before the last accepted one",
                 _group("hidden_from_wrong_row", fault_yaml=HIDDEN_FROM_WRONG_ROW), 1, 1, "hidden_in"),
)

# Not a serving fault but a broken engine: the scheduler raises in its first verify. SGLang's default answer
# (a SIGQUIT that kills the whole process tree, this session included) is replaced by a one-line failure of
# this group alone (conformance/adapters/sglang/engine.py).
CRASH_IN_VERIFY = """
patches:
  - target: sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify
    edits:
      - match: |
          return run_eagle_verify(
        prepend: |
          raise RuntimeError("planted crash in verify")
"""
CRASH = _group("crash_in_verify", fault_yaml=CRASH_IN_VERIFY)


# The MLA draft's layer normalises the recurrent hidden before its attention (kimi_k25_eagle3.py:160); a draft-only
# fault (the DeepSeek target shares DeepseekV2AttentionMLA and its forward_mla code with the draft, so a fault planted
# there would move the target's verify too).
MLA_HIDDEN_NORM_SKIPPED = """
patches:
  - target: sglang.srt.models.kimi_k25_eagle3.Eagle3MLADecoderLayer.forward
    edits:
      - match: |
          hidden_states = self.hidden_norm(hidden_states)
        replacement: |
          hidden_states = hidden_states
"""
MLA_FAULT_PROMPT = Prompt(4, 3)   # a request the MLA lane serves unfaulted too (mla_batch)
MLA_FAULTS = (
    PlantedFault("mla_hidden_norm_skipped", "SGLang's MLA draft layer feeds its attention the recurrent hidden "
                 "without hidden_norm (Eagle3MLADecoderLayer.forward)",
                 EngineGroup("mla_hidden_norm_skipped", steps=3, topk=1, draft_tokens=4, scenarios=(
                     Scenario("mla_hidden_norm_skipped", "planted fault mla_hidden_norm_skipped",
                              ((MLA_FAULT_PROMPT,),), new_tokens=8),), fault_yaml=MLA_HIDDEN_NORM_SKIPPED),
                 0, 0, "layers.0.attn_in"),
)
