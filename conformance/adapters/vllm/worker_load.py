"""The draft built and loaded as vLLM's proposer does (part of worker.py, in vLLM's environment):
SpecDecodeBaseProposer._create_draft_vllm_config / _get_model (vllm/v1/spec_decode/llm_base_proposer.py:
1265-1316: get_model under set_model_tag("eagle_head"), DefaultModelLoader -> load_weights), then what the
proposer shares from the target. The loaded drafts are kept here by handle (STATE) for the other requests."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from worker_config import DTYPES, draft_config_reading, engine_config, ensure_distributed
from worker_record import Recorder

STATE: dict = {"loaded": {}, "next": 0}


def build(req: dict, load_format: str = "auto"):
    """The draft's engine config and the draft built and loaded by vLLM's own path; (model, draft vllm config,
    speculative config). `load_format` "dummy": built, no weight read (vLLM's DummyModelLoader)."""
    from vllm.compilation.backends import set_model_tag
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    draft_dir, work = Path(req["ckpt"]), Path(req["work"])
    vllm_config = engine_config(draft_dir, req["dtype"], req.get("steps", 1), work, load_format=load_format)
    ensure_distributed(vllm_config)
    spec = vllm_config.speculative_config
    # as SpecDecodeBaseProposer._create_draft_vllm_config / _get_model (llm_base_proposer.py:1265-1316)
    draft_vllm_config = replace(vllm_config, attention_config=replace(vllm_config.attention_config,
                                                                       backend=spec.attention_backend))
    with set_current_vllm_config(draft_vllm_config), set_model_tag("eagle_head"):
        model = get_model(vllm_config=draft_vllm_config, model_config=spec.draft_model_config,
                          load_config=get_draft_load_config(draft_vllm_config))
    return model, draft_vllm_config, spec


def load(req: dict) -> dict:
    model, draft_vllm_config, spec = build(req)
    shared = share_from_target(model)
    handle = STATE["next"]
    STATE["next"] += 1
    STATE["loaded"][handle] = Loaded(model, draft_vllm_config, DTYPES[req["dtype"]], shared)
    hf = spec.draft_model_config.hf_config
    return {"handle": handle, "num_layers": len(model.model.layers), "reading": draft_config_reading(hf),
            "architecture": type(model).__name__, "shared": shared}


def share_from_target(model) -> list[str]:
    """What the proposer takes from the target model after loading a draft whose checkpoint lacks it
    (process_eagle_weight, vllm/model_executor/models/utils.py:1195-1198, sets has_own_lm_head /
    has_own_embed_tokens from the tensor names; SpecDecodeBaseProposer._maybe_share_embeddings /
    _maybe_share_lm_head, llm_base_proposer.py:1418-1523, then replace the draft's module by the target's).
    The harness's target is a config without weights, so the target's tensor is a seeded stand-in (never
    the draft's own embed_tokens: vLLM does not tie them); the trace notes say so."""
    shared = []
    generator = torch.Generator().manual_seed(20)
    for flag, module, what in (("has_own_embed_tokens", model.model.embed_tokens, "embed_tokens"),
                               ("has_own_lm_head", model.lm_head, "lm_head")):
        if not getattr(model, flag, True):
            weight = module.weight
            weight.data.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float32) * 0.02)
            shared.append(f"the checkpoint has no {what}: vLLM's proposer shares the target's "
                          f"(llm_base_proposer.py:1418-1523); here a seeded stand-in of the target's {what}")
    return shared


class Loaded:
    """One loaded draft: its model, draft vllm config and dtype, its attention layers and backend, the hooks
    that record its stages (Recorder) and, for `replay`, its last run's passes."""

    def __init__(self, model, vllm_config, dtype, shared: list[str]):
        self.model, self.vllm_config, self.dtype, self.shared = model, vllm_config, dtype, shared
        attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
        self.layer_names = [a.layer_name for a in attn]    # model.layers.{target layers + i}.self_attn.attn
        self.attn = attn
        self.backend = attn[0].attn_backend
        self.recorder = Recorder(model)
        self.ran: set[str] = set()   # filled only for a draft being accounted for (watch_runs)

    def watch_runs(self) -> None:
        """From now on, record the modules holding parameters that run in a forward (weight accounting: a
        parameter never loaded that nothing uses is not a loading problem)."""
        for name, module in self.model.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_hook(lambda m, a, o, name=name: self.ran.add(name))
