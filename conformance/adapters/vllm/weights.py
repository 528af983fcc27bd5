"""vLLM's weight accounting: its `load_weights` replayed in the worker with every parameter's `weight_loader`
observed (worker_accounting.py), and accounted for here like SGLang's (conformance/adapters/sglang/weights.py):
which checkpoint tensor reached which parameter, and which rows of a fused one (qkv_proj, gate_up_proj);
every landing verified bit for bit against the checkpoint (conformance/loading/accounting.py), the padded
vocabulary rows of embed_tokens / lm_head (VocabParallelEmbedding pads to a multiple of 64) aside.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from conformance.adapters.vllm.process import DTYPE_NAMES, Worker
from conformance.checkpoints import WEIGHTS_FILE
from conformance.loading.accounting import finite, load_and_count, observed_knobs, rope_text, vocab_map

# Where vLLM's proposer takes a module the checkpoint lacks from the target (llm_base_proposer.py:1418-1523).
SHARED = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}


def land_calls(acct, ckpt: dict, params: dict, answer: dict) -> set[str]:
    """The worker's observed load (`answer`: its calls, what is the draft's own, its sizes) entered in `acct`: every
    landing verified, the checkpoint tensors no call reached (t2d is skipped by vLLM's own code, llama_eagle3.py:426-427
    and deepseek_eagle3.py:376-377; anything else reached nothing), parameters that are not finite, the vocabulary
    map. -> the parameters no tensor filled that the draft does not take from the target."""
    for ckpt_name, pname, rows in answer["calls"]:
        acct.land_rows(ckpt_name, pname, params[pname], rows, ckpt.get(ckpt_name, torch.empty(0)))
    reached = {name for name, _, _ in answer["calls"]}
    for name in sorted(set(ckpt) - reached):
        (acct.ignored if "t2d" in name else acct.dropped).append(name)
    acct.nan = sorted(n for n, p in params.items() if not finite(p))
    acct.vocab_map = vocab_map(ckpt, answer["sizes"]["vocab"], answer["sizes"]["draft_vocab"])
    shared = {SHARED[what] for what, own in answer["own"].items() if not own}
    return set(params) - {pname for _, pname, _ in answer["calls"]} - shared


def account(adapter, ckpt_dir: Path, dtype: torch.dtype, target: dict | None, loaded):
    """`loaded`: the adapter's loaded-draft class, built on the worker's answer for the probe forward."""

    def observed_load() -> tuple:
        worker = Worker.get()
        work = worker.scratch()
        answer = worker.ask("account", ckpt=str(ckpt_dir.resolve()), weights=str(ckpt_dir.resolve() / WEIGHTS_FILE),
                            dtype=DTYPE_NAMES[dtype], work=str(work), params=str(work / "params.safetensors"),
                            steps=1)
        return loaded(worker, answer, dtype), answer, load_file(str(work / "params.safetensors"))

    acct, ckpt, got = load_and_count(adapter.name, ckpt_dir, observed_load)
    if got is None:
        return acct
    loaded, answer, params = got
    never = sorted(land_calls(acct, ckpt, params, answer))
    sizes = answer["sizes"]
    acct.uses = uses(answer, target)
    knobs = dict(answer["knobs"])
    seen = observed_knobs(loaded, sizes["aux_width"], sizes["vocab"], ckpt, params)
    knobs["rope"] = rope_text(*knobs["rope"])
    fc = knobs.pop("fc in -> out")
    acct.knobs = {"aux states x width": knobs.pop("aux states x width"), "fc": f"{fc}, {seen['fc']}", **knobs,
                  "norm_before_residual": seen["norm_before_residual"],
                  "layers >= 1 pre-norm": seen["layers >= 1 pre-norm"]}
    # A parameter no tensor filled whose module never ran (the probe run of observed_knobs, the draft's
    # forward) is not a loading problem: vLLM builds hidden_norm in every layer but only layer 0 applies it
    # (llama_eagle3.py:127-131).
    ran = set(loaded.worker.ask("ran", handle=loaded.handle)["modules"])
    for name in never:
        if name.rsplit(".", 1)[0] in ran:
            acct.never_loaded.append(name)
        else:
            acct.ignored.append(f"{name} (never loaded, never run)")
    return acct


def uses(answer: dict, target: dict | None) -> dict[str, str]:
    """What embed_tokens, lm_head and d2t really are when vLLM serves this draft."""
    own, sizes = answer["own"], answer["sizes"]
    embed = "checkpoint" if own["embed_tokens"] else \
        "the target's (none in the checkpoint: _maybe_share_embeddings, llm_base_proposer.py:1418-1493)"
    if target is not None and not own["embed_tokens"] and target.get("hidden_size") != sizes["hidden"]:
        embed = (f"NEVER LOADED: none in the checkpoint and the target's is {target.get('hidden_size')} wide, the "
                 f"draft's {sizes['hidden']}, so vLLM keeps its own (llm_base_proposer.py:1472-1489)")
    elif own["embed_tokens"]:
        embed += "; the target's when equal to it (llm_base_proposer.py:1445-1461)"
    return {
        "embed_tokens": embed,
        "lm_head": "checkpoint lm_head" if own["lm_head"] else
                   "the target's lm_head (none in the checkpoint: _maybe_share_lm_head, "
                   "llm_base_proposer.py:1495-1523)",
        "d2t": "draft_id_to_target_id (compute_logits scatters into the full vocabulary)"
               if sizes["draft_vocab"] != sizes["vocab"] else "none: draft ids used as target ids",
    }
