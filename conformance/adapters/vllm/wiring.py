"""vLLM as a serving side of the target wiring: which target boundaries vLLM feeds a draft, read by vLLM's
own code in the worker (worker_ids.py aux_layers: its config readers, its model runner's id selection, the
target's default list).

The ids become boundaries by vLLM's capture convention, the same in every target class the suite's wiring
covers: id i is the residual stream entering decoder layer i (0: the embedding output, N: the last layer's
output before the final norm), captured in forward order, each boundary once:
- Llama / Qwen3 / gpt-oss: `_maybe_add_hidden_state(aux, start_layer, ...)` before the first layer and
  `(aux, idx + 1, ...)` after layer idx (model_executor/models/llama.py:427-441, qwen2.py:424-432,
  gpt_oss.py:526-532; interfaces.py:1640-1650 appends `hidden_states + residual` when the id is listed);
- DeepSeek-V2/V3 (and Kimi-K2.5, which delegates to it, kimi_k25.py:470-474): before layer idx when idx
  is listed, and after the last layer for N (deepseek_v2.py:1561-1568, :1586-1587); before layer 0 the
  residual is None, so id 0 raises (`hidden_states + residual`).
Where vLLM's target class runs on this host (Llama, Qwen3: the shims' attention), the served list is
observed (worker_capture.py): the class built by get_model with its aux layers set as its model runner sets
them, one forward, each returned aux state matched exactly to a boundary; and the derivation above must give
the same list (conformance/wiring/test_serving_sides.py). Where it does not (DeepSeek-V3 / Kimi-K2.5: MLA
attention has no backend on a CPU host; gpt-oss: no unquantized MoE backend), the list is derived, and says so;
DeepSeek's forward still runs up to its first decoder layer, so id 0's TypeError is observed (and the rule's
derived error must agree: no list).
"""
from __future__ import annotations

from pathlib import Path

from conformance.adapters.vllm.process import Worker

# Where each model runner reads the ids (the user verdict's cause), and the capture convention that follows.
READER = {
    "v2": "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:116-152 (Model Runner V2: top-level "
          "eagle_aux_hidden_state_layer_ids, else eagle_config.layer_ids); id i = the input of layer i "
          "(model_executor/models/llama.py:427-441)",
    "v1": "vllm/v1/worker/gpu_model_runner.py:5190-5221 (V1 runner: top-level eagle_aux_hidden_state_layer_ids, "
          "else eagle_config's, as written); id i = the input of layer i (model_executor/models/llama.py:427-441)",
}

# Target classes (architectures[0] of the target config) whose capture fails at boundary 0: the residual
# is None before the first layer (deepseek_v2.py:1561-1562).
NO_EMBEDDING_CAPTURE = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration")


def served_boundaries(draft_dir: Path, target_config: Path, num_layers: int, runner: str) -> dict:
    """What vLLM with model runner `runner` ("v1" | "v2") reads from `draft_dir`/config.json and which boundaries
    0..num_layers it then feeds the draft.

    Returns {"read": readable, "ids": the ids its runner passes (None: the target's default), "served":
    boundaries in slot order, "error": one line when vLLM refuses the config or the capture fails, "error_class":
    the class of what vLLM raised ("" when nothing did), "observed":
    whether a forward of vLLM's target class gave "served" (else derived, "derived_why" says why), "derived":
    the derived list (equal to "served" where observed, which the wiring tests require)}."""
    import json

    worker = Worker.get()
    where = {"draft": str(Path(draft_dir).resolve()), "target": str(Path(target_config).resolve()), "runner": runner}
    try:
        answer = worker.ask("aux_layers", **where, work=str(worker.scratch()))
    except Exception as exc:   # vLLM refused the draft or target config: its own words, one line
        return {"read": "nothing", "ids": None, "served": None, "error": f"{type(exc).__name__}: {exc}",
                "error_class": type(exc).__name__, "reading": {}, "observed": False, "derived": None,
                "derived_why": "vLLM refused the config", "reader": READER[runner]}
    ids = answer["ids"]
    used = tuple(ids) if ids is not None else tuple(answer["default"])
    where_read = ("top level or eagle_config" if runner == "v1" else
                  "top level; the V2 runner reads eagle_config's layer_ids, not its eagle_aux_hidden_state_layer_ids")
    read = (f"ids {list(ids)} (eagle_aux_hidden_state_layer_ids, {where_read}, as written)"
            if ids is not None else f"no ids: the target's default {list(answer['default'])}")
    served = tuple(b for b in sorted(set(used)) if 0 <= b <= num_layers)
    architecture = (json.loads(Path(target_config).read_text()).get("architectures") or [""])[0]
    error = error_class = ""
    if 0 in served and architecture in NO_EMBEDDING_CAPTURE:   # `hidden_states + residual`, residual None
        error_class = "TypeError"
        error = ("target forward: TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType' (derived: "
                 "id 0 adds a None residual before the first layer, deepseek_v2.py:1561-1562)")
        served = None
    if answer["v2_unsupported"] and runner == "v2":   # vLLM itself would run V1 for this config
        read += f"; note: vLLM runs its V1 runner for this config ({', '.join(answer['v2_unsupported'])})"
    derived = {"read": read, "ids": ids, "served": served, "error": error, "error_class": error_class,
               "reading": answer["reading"], "observed": False, "derived": served, "reader": READER[runner]}
    seen = worker.ask("capture", **where, work=str(worker.scratch()))
    if not seen["ran"]:
        return {**derived, "derived_why": f"vLLM's target class does not run here: {seen['why']}"}
    observed, error = None if seen["served"] is None else tuple(seen["served"]), seen["error"]
    error_class = seen["error_class"]
    if observed is not None and -1 in observed:   # nothing raised: no exception class
        observed, error, error_class = None, f"aux states matching no boundary exactly (slots {seen['served']}, " \
            "-1: none)", ""
    return {**derived, "served": observed, "error": error, "error_class": error_class, "observed": True}
