"""Target-side wiring, observed (part of worker.py, in vLLM's environment): vLLM's target class built for a
config, its aux layers set as the model runner sets them (worker_ids.py), one forward, and each aux state it
returns matched to the residual-stream boundary that holds it."""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import shims
import torch
from worker_config import BLOCK_SIZE, engine_config, ensure_distributed
from worker_ids import runner_aux_layers
from worker_pipe import first_line
from worker_run import kv_cache


class AttentionUnrunnable(Exception):
    """The forward reached a decoder layer whose attention has no backend here."""


def stop(module, args):
    """A pre-hook on the first decoder layer of a class whose attention cannot run here."""
    raise AttentionUnrunnable


def capture(req: dict) -> dict:
    """The target's capture observed: vLLM's target class for this config built by get_model (random weights:
    load_format "dummy"; the capture does not depend on them), its aux layers set as GPUModelRunner.
    _setup_eagle3_aux_hidden_state_outputs does (the config's ids, else the class's default; :5169-5188), one
    forward over a request, and each aux state it returns matched exactly to the residual stream entering a
    decoder layer (boundary i) or the final norm (boundary N). A class that does not run here (no CPU path for its
    attention) answers `ran: False` with vLLM's own words, unless its forward raises before its first decoder
    layer (an MLA class: the embedding and boundary 0's capture run)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.attention.backend import CommonAttentionMetadata

    target = json.loads(Path(req["target"]).read_text())
    vllm_config = engine_config(Path(req["draft"]), "float32", 1, Path(req["work"]), target, load_format="dummy")
    ensure_distributed(vllm_config)
    try:
        with set_current_vllm_config(vllm_config):
            model = get_model(vllm_config=vllm_config)
        # as each runner sets them up: V1 _setup_eagle3_aux_hidden_state_outputs (gpu_model_runner.py:5169-5188),
        # V2 set_eagle3_aux_hidden_state_layers (eagle3_utils.py:25-40): the config's ids, else the class default
        ids = runner_aux_layers(req["runner"], vllm_config.speculative_config)
        ids = ids or model.get_eagle3_default_aux_hidden_state_layers()
        if req.get("plant") == "ids_one_deeper":   # the meta test's fault: a runner that adds 1 to every id
            ids = tuple(i + 1 for i in ids)
        model.set_aux_hidden_state_layers(ids)
        inner = next(m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
        attn = [m for m in model.modules() if hasattr(m, "attn_backend") and hasattr(m, "layer_name")]
        holder = SimpleNamespace(backend=attn[0].attn_backend, attn=attn, vllm_config=vllm_config)
    except Exception as exc:   # vLLM's own words: this class cannot be built here
        traceback.print_exc()
        return {"ran": False, "why": f"{type(exc).__name__}: {first_line(exc)}"}
    # MLA attention cannot run here: vLLM's forward runs only up to the first decoder layer (embedding, boundary
    # 0's capture: no attention), so what it raises there is observed; reaching layer 0 means it does not run
    unrunnable = (f"{type(model).__name__} uses MLA attention: vLLM's CPU MLA backend calls its CPU build's "
                  "compiled ops (v1/attention/backends/mla/cpu_mla.py:180), absent from the CUDA wheel, and "
                  "FLEX_ATTENTION (the shim's) is not an MLA backend"
                  if vllm_config.model_config.use_mla and shims.APPLIED else "")
    T = 6
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.get_text_config().vocab_size, (T,), generator=generator)
    positions = torch.arange(T)
    slot_map = BLOCK_SIZE + torch.arange(T)
    names = [] if unrunnable else [a.layer_name for a in attn]
    metadata = {}
    if not unrunnable:
        specs = kv_cache(holder, 2)
        vllm_config.cache_config.num_gpu_blocks = 2
        block_table = torch.ones(1, 1, dtype=torch.int32)   # block 1: block 0 is the null block
        qsl = torch.tensor([0, T], dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor([T], dtype=torch.int32),
            num_reqs=1, num_actual_tokens=T, max_query_len=T, max_seq_len=T, block_table_tensor=block_table,
            slot_mapping=slot_map, causal=True, positions=positions)
        metadata = {name: holder.backend.get_builder_cls()(spec, [name], vllm_config, torch.device("cpu")).build(
            common_prefix_len=0, common_attn_metadata=cad) for spec, name in zip(specs, names)}
    streams: dict[int, torch.Tensor] = {}

    def stream(hidden, residual):
        return (hidden if residual is None else hidden + residual).detach().clone()

    def entering(i, hidden_at):   # observation only: a pre-hook returning None leaves the call as it was
        def pre(module, args):
            streams.setdefault(i, stream(args[hidden_at], args[hidden_at + 1] if len(args) > hidden_at + 1 else None))
        return pre

    # decoder layers are called (positions, hidden_states, residual); the final norm (hidden_states, residual)
    handles = [layer.register_forward_pre_hook(entering(i, 1)) for i, layer in enumerate(inner.layers)]
    handles.append(inner.norm.register_forward_pre_hook(entering(len(inner.layers), 0)))
    if unrunnable:
        handles.append(inner.layers[0].register_forward_pre_hook(stop))
    def forward():
        with torch.no_grad(), set_forward_context(metadata, vllm_config, num_tokens=T,
                                                  slot_mapping={name: slot_map for name in names}):
            return model(input_ids=tokens, positions=positions, intermediate_tensors=None)

    try:
        try:
            out = forward()
        except Exception as exc:   # torch 2.14's Inductor codegen failure after other shapes (see run())
            if type(exc).__name__ != "InductorError":
                raise
            torch._dynamo.reset()
            streams.clear()
            out = forward()
    except AttentionUnrunnable:
        return {"ran": False, "why": f"NotImplementedError: {unrunnable}"}
    except Exception as exc:   # the capture itself fails (e.g. a None residual): vLLM's own words
        traceback.print_exc()
        return {"ran": True, "ids": list(ids), "served": None, "error": f"{type(exc).__name__}: {first_line(exc)}",
                "error_class": type(exc).__name__, "architecture": type(model).__name__}
    finally:
        for h in handles:
            h.remove()
    aux = out[1] if isinstance(out, tuple) else []
    served = []
    for state in aux:
        same = [b for b, s in sorted(streams.items()) if s.shape == state.shape and torch.equal(s, state)]
        served.append(same[0] if len(same) == 1 else -1)   # -1: no single boundary holds exactly this state
    return {"ran": True, "ids": list(ids), "served": served, "error": "", "error_class": "",
            "architecture": type(model).__name__}
