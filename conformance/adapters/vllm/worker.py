"""vLLM's EAGLE-3 draft (`Eagle3LlamaForCausalLM`), built, loaded and run by vLLM's own code, in vLLM's own
environment (.venv-vllm: `python worker.py`). One persistent process per test session (importing vLLM
takes 30-50 s); adapter.py drives it over a pipe: one JSON request per line in, one JSON answer per line
out, tensors through safetensors files. Self-contained: it imports nothing of the project (whose
environment pins another torch and transformers), only vLLM, torch, safetensors, shims.py next to it and the
project's self-contained conformance/loading/observed_loaders.py.

What is vLLM's and what is the harness's:
- vLLM's: the config (EngineArgs -> create_engine_config, with its readers of the SGLang and speculators
  draft formats), the draft vllm config and the model build and load as its proposer does them
  (SpecDecodeBaseProposer._create_draft_vllm_config / _get_model, vllm/v1/spec_decode/llm_base_proposer.py:
  1265-1316: get_model under set_model_tag("eagle_head"), DefaultModelLoader -> load_weights), every layer,
  combine_hidden_states, the attention backend's metadata builder, compute_logits with its d2t scatter.
- the harness's (as the SGLang adapter builds SGLang's ForwardBatch): the target model config (a tiny
  LlamaForCausalLM config.json, no weights), the KV cache tensor, block tables and slot mapping that vLLM's
  scheduler and GPUModelRunner would give, and the calls the proposer makes (`propose()`, llm_base_proposer.py:
  511-770, needs the runner's device buffers): step 0 is the model over every scheduled token (:549-614),
  steps >= 1 one query per request on its last token, with the previous step's second output as hidden and
  the argmax of compute_logits as input id (:683-760). Block 0 is vLLM's null block (the KV cache manager
  never hands it out; block-table padding is 0), so tables start at 1.
- shims.py on a host without CUDA.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

# The protocol channel is the original stdout; everything else (vLLM's logging, warnings) goes to stderr.
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loading"))   # observed_loaders.py: self-contained
import shims  # noqa: E402
from observed_loaders import observed_weight_loaders  # noqa: E402

import vllm  # noqa: E402

TARGET_LAYERS = 8          # the tiny target's depth; aux ids (2, 4, 5) are inputs of its layers
BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
STATE: dict = {"loaded": {}, "next": 0, "distributed": False}
# Harness faults the meta tests plant (conformance/meta/test_vllm_worker.py) to show the comparison catches them.
PLANTS = ("kv_write_next_slot", "null_block")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---------------------------------------------------------------- config and load

def target_config(draft_dir: Path, work: Path, target: dict | None) -> Path:
    """A tiny LlamaForCausalLM config.json as the target (vLLM needs one; no weights are read): as wide and
    with the vocabulary the draft says, or the one the caller gives (wiring)."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    hidden = cfg.get("target_hidden_size") or layer.get("target_hidden_size") or layer["hidden_size"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": layer["vocab_size"],
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": TARGET_LAYERS,
        "num_attention_heads": 4 if hidden % 4 == 0 else 1, "num_key_value_heads": 2 if hidden % 4 == 0 else 1,
        "head_dim": hidden // 4 if hidden % 4 == 0 else hidden,
        "max_position_embeddings": layer.get("max_position_embeddings", 2048),
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    if target:   # the caller's target (wiring): its own config, as given
        config = target
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(config, indent=2))
    return work


def engine_config(draft_dir: Path, dtype: str, steps: int, work: Path, target: dict | None = None,
                  load_format: str = "auto"):
    from vllm.engine.arg_utils import EngineArgs

    tdir = target_config(draft_dir, work, target)
    written = json.loads((tdir / "config.json").read_text())
    max_len = min(4096, written.get("max_position_embeddings")
                  or written.get("text_config", {}).get("max_position_embeddings") or 2048)
    args = EngineArgs(
        model=str(tdir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
        # up to the benchmark sweep's largest step 0 in one pass (32 requests of 1,024 tokens) and its 32 requests
        max_model_len=max_len, max_num_seqs=32, max_num_batched_tokens=max(32768, max_len), block_size=BLOCK_SIZE,
        speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": max(1, steps)},
        # vLLM's default whenever Inductor compiles: every CustomOp runs its forward_native
        compilation_config={"custom_ops": ["none"], "mode": 0},
        load_format=load_format, trust_remote_code=False,
    )
    return args.create_engine_config()


def ensure_distributed(vllm_config) -> None:
    """World size 1 over gloo, once per process (vLLM's parallel layers need the groups)."""
    if STATE["distributed"]:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    init_file = Path(tempfile.mkdtemp(prefix="vllm-gloo-")) / "init"
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    STATE["distributed"] = True


def draft_config_reading(hf) -> dict:
    """What vLLM read from the draft's config (its hf_config after its own readers)."""
    keys = ("architectures", "eagle_aux_hidden_state_layer_ids", "eagle_config", "norm_before_residual",
            "norm_before_fc", "fc_norm", "norm_output", "draft_vocab_size", "target_hidden_size",
            "num_aux_hidden_states", "num_hidden_layers", "sliding_window", "attention_bias", "mlp_bias",
            "head_dim", "rope_parameters", "rope_scaling", "tie_word_embeddings")
    out = {}
    for k in keys:
        v = getattr(hf, k, "<absent>")
        out[k] = v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
    return out


def load(req: dict) -> dict:
    from vllm.compilation.backends import set_model_tag
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    draft_dir, work = Path(req["ckpt"]), Path(req["work"])
    vllm_config = engine_config(draft_dir, req["dtype"], req.get("steps", 1), work)
    ensure_distributed(vllm_config)
    spec = vllm_config.speculative_config
    # as SpecDecodeBaseProposer._create_draft_vllm_config / _get_model (llm_base_proposer.py:1265-1316)
    draft_vllm_config = replace(vllm_config, attention_config=replace(vllm_config.attention_config,
                                                                       backend=spec.attention_backend))
    with set_current_vllm_config(draft_vllm_config), set_model_tag("eagle_head"):
        model = get_model(vllm_config=draft_vllm_config, model_config=spec.draft_model_config,
                          load_config=get_draft_load_config(draft_vllm_config))
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


# ---------------------------------------------------------------- weight accounting: vLLM's load_weights observed

# vLLM's rotary classes by the rope_type they implement (model_executor/layers/rotary_embedding/).
ROPE_TYPES = {"RotaryEmbedding": "default", "LinearScalingRotaryEmbedding": "linear",
              "Llama3RotaryEmbedding": "llama3", "YaRNScalingRotaryEmbedding": "yarn",
              "DeepseekScalingRotaryEmbedding": "deepseek_yarn"}


def account(req: dict) -> dict:
    """The draft loaded as `load` does, then its `load_weights` replayed with every parameter's `weight_loader`
    observed (the wrapper records the call and forwards it: values are rewritten with themselves). vLLM's loader
    first collects the renamed tensors in a dict (llama_eagle3.py:420-470), so a call is tied to its checkpoint
    tensor by storage, not by iteration order. Answers the calls (tensor, parameter, rows of a fused one), the
    parameters after loading (a safetensors file: the adapter verifies each landing by value) and the knobs the
    built modules state; the adapter observes the rest by running the draft (`handle`)."""
    from safetensors import safe_open

    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    answer = load(req)
    loaded: Loaded = STATE["loaded"][answer["handle"]]
    loaded.watch_runs()   # the adapter's probe run then says which modules run (`ran`)
    model = loaded.model
    params = dict(model.named_parameters())
    with safe_open(req["weights"], framework="pt") as f:
        ckpt = {name: f.get_tensor(name) for name in f.keys()}
    by_storage = {t.untyped_storage().data_ptr(): name for name, t in ckpt.items()}
    calls: list[list] = []

    def record(pname, tensor, shard):
        name = by_storage.get(tensor.untyped_storage().data_ptr(), "<not a checkpoint tensor>")
        calls.append([name, pname, shard_rows(model, pname, shard)])

    with observed_weight_loaders(params, default_weight_loader, record), torch.no_grad():
        model.load_weights(iter(ckpt.items()))
    save_file({name: p.detach().contiguous().clone() for name, p in params.items()}, req["params"])
    return {**answer, "calls": calls, "knobs": built_knobs(model),
            "own": {"embed_tokens": bool(getattr(model, "has_own_embed_tokens", True)),
                    "lm_head": bool(getattr(model, "has_own_lm_head", True))},
            "sizes": {"vocab": int(model.config.vocab_size), "draft_vocab": int(model.config.draft_vocab_size),
                      "hidden": int(model.config.hidden_size),
                      "aux_width": int(getattr(model.model, "fc_input_size", model.config.hidden_size))}}


def ran(req: dict) -> dict:
    """The modules with parameters that have run in a forward of this draft so far."""
    return {"modules": sorted(STATE["loaded"][req["handle"]].ran)}


def shard_rows(model, pname: str, shard) -> list[int] | None:
    """Rows of a fused parameter (qkv_proj: [q | k | v], gate_up_proj: [gate | up]) one shard fills; None when
    not fused. vLLM's `output_sizes` are the shards' widths (layers/linear.py:727, :1073-1077)."""
    if shard is None:
        return None
    module = model.get_submodule(pname.rsplit(".", 1)[0])
    index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
    start = sum(module.output_sizes[:index])
    return [start, start + module.output_sizes[index]]


def built_knobs(model) -> dict:
    """The knob values the built modules state (the knob table's rows; observed ones come from the adapter)."""
    inner, cfg = model.model, model.config
    attn = inner.layers[0].self_attn
    rope = attn.rotary_emb
    window = getattr(attn.attn, "sliding_window", None)
    fc = getattr(inner, "fc", None)
    # Llama drafts: num_aux_hidden_states (llama_eagle3.py:209-221); Qwen3: num_aux_layers (qwen3_eagle3.py:201-211)
    aux = getattr(inner, "num_aux_hidden_states", None) or getattr(inner, "num_aux_layers", None)
    return {
        "aux states x width": f"{aux} x {inner.fc_input_size // aux}" if inner.use_aux_hidden_state
                              else "none (use_aux_hidden_state false)",
        "fc in -> out": f"{fc.input_size} -> {fc.output_size}" if fc is not None else "none",
        "norm_before_fc": inner.norm_before_fc, "fc_norm": getattr(inner, "fc_norm", None) is not None,
        "norm_output": bool(inner.norm_output),
        "layers": len(inner.layers),
        "heads / kv heads / head_dim": f"{attn.total_num_heads}/{attn.total_num_kv_heads}/{attn.head_dim}",
        "rope": [ROPE_TYPES.get(type(rope).__name__, type(rope).__name__), float(rope.base)],
        "q/k/v bias": attn.qkv_proj.bias is not None,
        "mlp bias": getattr(inner.layers[0].mlp.gate_up_proj, "bias", None) is not None,
        "sliding window": window if window not in (None, -1) else "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{cfg.draft_vocab_size}",
    }


# ---------------------------------------------------------------- the forward, as the proposer runs it

class Loaded:
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


class Recorder:
    """Forward hooks on vLLM's modules (observation only; every hook returns None), per decoder layer."""

    def __init__(self, model):
        self.seen: dict = {}
        self.layer = None
        self.on = True
        inner = model.model

        def enter(i):
            def pre(module, args, kwargs):
                self.layer = i
            return pre

        def keep(name, pick):
            def hook(module, args, output):
                if self.on:
                    key = name if self.layer is None else f"{self.layer}.{name}"
                    self.seen.setdefault(key, clone(pick(args, output)))
            return hook

        def keep_in(name, pick):
            def pre(module, args, kwargs):   # before the call: a fused add-norm may update its inputs in place
                if self.on:
                    key = name if self.layer is None else f"{self.layer}.{name}"
                    self.seen.setdefault(key, clone(pick(args, kwargs)))
            return pre

        def out(a, o):
            return o

        def residual_arg(args, kwargs):
            return args[1] if len(args) > 1 else kwargs["residual"]

        hooks = [(inner.embed_tokens, "embed_tokens"), (inner.norm, "norm"), (inner.fc, "fc"),
                 (model.logits_processor, "logits")]
        if getattr(inner, "input_norm", None) is not None:
            hooks.append((inner.input_norm, "input_norm"))
        for j, norm in enumerate(getattr(inner, "fc_norm", None) or []):
            hooks.append((norm, f"fc_norm.{j}"))
        self.handles = []
        for i, layer in enumerate(inner.layers):
            self.handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(lambda m, a, o: setattr(self, "layer", None)))
            attn = layer.self_attn
            hooks += [(layer.hidden_norm, "hidden_norm"), (layer.input_layernorm, "input_layernorm"),
                      (attn.qkv_proj, "qkv"), (attn.rotary_emb, "rotary"), (attn.attn, "attn"),
                      (attn.o_proj, "o_proj"), (layer.post_attention_layernorm, "post_attention_layernorm"),
                      (layer.mlp, "mlp")]
            # Qwen3 draft layers: per-head RMSNorm of q and k before RoPE (model_executor/models/qwen3.py:163-169)
            hooks += [(getattr(attn, n), n) for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
            self.handles.append(attn.qkv_proj.register_forward_pre_hook(keep_in("qkv_in", lambda a, k: a[0]),
                                                                        with_kwargs=True))
            # The residual the attention output is added to: what the fused add-norm receives.
            self.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
                keep_in("residual", residual_arg), with_kwargs=True))
        done = set()
        for module, name in hooks:
            if (id(module), name) not in done:   # a shared module (get_rope's cache) is hooked once per name
                done.add((id(module), name))
                self.handles.append(module.register_forward_hook(keep(name, out)))

    def take(self) -> dict:
        seen, self.seen, self.layer = self.seen, {}, None
        return seen


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(clone(v) for v in x)
    return x


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def canonical(loaded: Loaded, seen: dict, ids, hidden_fed, aux_out) -> dict:
    """One pass's hooks as canonical stages (conformance/core/stages.py), fused layouts split back."""
    model = loaded.model
    hf = model.config
    nh, nkv = hf.num_attention_heads, hf.num_key_value_heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // nh
    T = ids.shape[0]
    layers = len(model.model.layers)
    s: dict = {}
    if hidden_fed is not None:   # a draft step >= 1 is fed the previous step's second output
        s["hidden_in"] = hidden_fed
    s["input_ids"] = ids.clone().long()
    s["embeds"] = seen["embed_tokens"]
    for i in range(layers):
        p = f"layers.{i}."
        if i == 0:
            s[p + "embeds_norm"] = first(seen["0.input_layernorm"])
            s[p + "hidden_norm"] = first(seen["0.hidden_norm"])
        else:   # later layers: the fused input_layernorm(h, residual) -> (normed, sum) (llama_eagle3.py:138)
            s[p + "hidden_norm"] = seen[f"{i}.input_layernorm"][0]
            s[f"layers.{i - 1}.layer_out"] = seen[f"{i}.input_layernorm"][1]
        s[p + "residual"] = seen[f"{i}.residual"]
        s[p + "attn_in"] = seen[f"{i}.qkv_in"]
        q, k, v = first(seen[f"{i}.qkv"]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        s[p + "q"], s[p + "k"], s[p + "v"] = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        for name, heads in (("q_norm", nh), ("k_norm", nkv)):
            if f"{i}.{name}" in seen:
                s[p + name] = seen[f"{i}.{name}"].reshape(T, heads, hd)
        q_rot, k_rot = seen[f"{i}.rotary"]
        s[p + "q_rot"], s[p + "k_rot"] = q_rot.reshape(T, nh, hd), k_rot.reshape(T, nkv, hd)
        s[p + "attn_core"] = seen[f"{i}.attn"].reshape(T, nh * hd)
        s[p + "attn_out"] = first(seen[f"{i}.o_proj"])
        s[p + "post_attn_norm"], s[p + "post_attn"] = seen[f"{i}.post_attention_layernorm"]
        s[p + "mlp_out"] = seen[f"{i}.mlp"]
    s["final_norm"], s[f"layers.{layers - 1}.layer_out"] = seen["norm"]   # the fused (normed, sum) of the last layer
    s["recurrent_hidden"] = aux_out
    return s


def kv_cache(loaded: Loaded, num_blocks: int):
    """One KV cache per draft layer: the logical view [blocks, kv heads, block, 2*head] in the memory layout
    the backend asks for (vllm/v1/worker/utils.py allocate_kv_cache): FLEX_ATTENTION LBNHC, memory [blocks,
    block, kv heads, 2*head] (flex_attention.py:130-133); CPU_ATTN LBHNC, the view itself (cpu_attn.py:82-84)."""
    layout = loaded.backend.supported_kv_cache_layouts()[0].name
    specs = []
    for attn in loaded.attn:
        spec = attn.get_kv_cache_spec(loaded.vllm_config)
        if layout == "LBNHC":
            cache = torch.zeros(num_blocks, spec.block_size, spec.num_kv_heads, 2 * spec.head_size,
                                dtype=spec.dtype).permute(0, 2, 1, 3)
        else:
            cache = torch.zeros(num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=spec.dtype)
        attn.kv_cache = cache
        specs.append(spec)
    return specs


def run(req: dict) -> dict:
    """One draft run; once more from a fresh compile cache when Inductor's codegen fails.

    torch 2.14.0 (vLLM's pin) can emit C++ that does not compile for the CPU flex-attention template when it
    recompiles with dynamic shapes after a sliding-window run (`'cur_kvSplitSize9' was not declared`,
    seen with the suite's window cases): torch._dynamo.reset() drops the compiled frames, so the next call
    compiles for the static shapes it sees. The same vLLM code runs; the trace notes say when this happened.
    """
    plant = req.get("plant")
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}: {PLANTS}")
    shims.SLOT_SHIFT = 1 if plant == "kv_write_next_slot" else 0
    try:
        return _run(req)
    except Exception as exc:
        if type(exc).__name__ != "InductorError":
            raise
        torch._dynamo.reset()
        answer = _run(req)
        answer["notes"].append(f"torch Inductor codegen failed ({first_line(exc)}); recompiled from an empty "
                               "dynamo cache (torch._dynamo.reset()) and ran again")
        return answer
    finally:
        shims.SLOT_SHIFT = 0


def _run(req: dict) -> dict:
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    loaded: Loaded = STATE["loaded"][req["handle"]]
    model, cfg, dt = loaded.model, loaded.vllm_config, loaded.dtype
    batch = load_file(req["batch"])
    meta = req["meta"]
    steps, record = req["steps"], req.get("record", True)
    aux, ids, positions, seq_ids = batch["aux"], batch["input_ids"], batch["positions"], batch["seq_ids"]
    next_ids = batch.get("next_ids")
    lengths = torch.bincount(seq_ids).tolist()
    B, T = len(lengths), sum(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    last = starts + torch.tensor(lengths) - 1
    index_in_request = torch.arange(T) - starts[seq_ids]
    prefix = meta.get("cached_prefix") or [0] * B
    if not all(0 <= p < n for p, n in zip(prefix, lengths)):
        raise ValueError(f"cached_prefix {prefix} must leave at least one token of each sequence {lengths}")

    # Blocks: each request owns enough for its tokens and the draft steps; block 0 is the null block.
    block_size = loaded.attn[0].get_kv_cache_spec(cfg).block_size
    per_req = (max(lengths) + steps + block_size - 1) // block_size
    num_blocks = 1 + B * per_req
    specs = kv_cache(loaded, num_blocks)
    cfg.cache_config.num_gpu_blocks = num_blocks   # set by the engine after profiling
    first_block = 0 if req.get("plant") == "null_block" else 1   # planted: requests own vLLM's null block 0
    block_table = (first_block + torch.arange(B * per_req).reshape(B, per_req)).int()
    builders = [loaded.backend.get_builder_cls()(spec, [name], cfg, torch.device("cpu"))
                for spec, name in zip(specs, loaded.layer_names)]

    def slots(req_ids, index):   # the KV slot of a request's token `index` (its logical position in the request)
        return block_table[req_ids, index // block_size].long() * block_size + index % block_size

    def forward(input_ids, pos, hidden, query_lens, seq_lens, slot_map):
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=B,
            num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table, slot_mapping=slot_map, causal=True, positions=pos)
        md = {name: b.build(common_prefix_len=0, common_attn_metadata=cad) for name, b in zip(loaded.layer_names,
                                                                                          builders)}
        loaded.recorder.take()
        with set_forward_context(md, cfg, num_tokens=int(qsl[-1]),
                                 slot_mapping={name: slot_map for name in loaded.layer_names}):
            last_hidden, aux_out = model(input_ids=input_ids, positions=pos, hidden_states=hidden)
        return last_hidden, aux_out, loaded.recorder.take()

    loaded.recorder.on = record
    loaded.passes = []   # each draft step's bare pass (no hooks recorded), for `replay`
    out_steps, out_rows = [], []
    with torch.no_grad():
        # Step 0: combine_hidden_states, then the model over every scheduled token (llm_base_proposer.py:549-601),
        # in two chunks when the request extends over a cached prefix (chunked prefill).
        aux_dt = aux.to(dt)
        fed = model.combine_hidden_states(aux_dt)
        fc_seen = loaded.recorder.take()
        st: dict = {}
        if record:
            st["aux_in"] = aux_dt
            norms = [first(fc_seen[k]) for k in sorted(k for k in fc_seen if k.startswith("fc_norm."))]
            if norms:
                st["fc_in_norm"] = torch.cat(norms, dim=-1)
            elif "input_norm" in fc_seen:
                st["fc_in_norm"] = first(fc_seen["input_norm"])
            st["fc_out"] = fed
        chunks = [[(0, p) for p in prefix], [(p, n) for p, n in zip(prefix, lengths)]] if any(prefix) else \
            [[(0, n) for n in lengths]]
        for chunk in chunks:
            rows = torch.cat([torch.arange(a, b) + s0 for (a, b), s0 in zip(chunk, starts.tolist())])
            args = (ids[rows].int(), positions[rows].long(), fed[rows], [b - a for a, b in chunk],
                    [b for _, b in chunk], slots(seq_ids[rows], index_in_request[rows]))
            last_hidden, aux_out, seen = forward(*args)
            if record:
                part = canonical(loaded, seen, ids[rows], None, aux_out)
                for name, value in part.items():
                    st.setdefault(name, value.new_empty((T, *value.shape[1:])))[rows] = value
            else:
                st.setdefault("recurrent_hidden", aux_out.new_empty((T, *aux_out.shape[1:])))[rows] = aux_out
            hidden_rows = rows
        # logits on each request's last token (:614), greedy: argmax of compute_logits (d2t scatter) (:447)
        sample_rows = torch.searchsorted(hidden_rows, last)
        sample = last_hidden[sample_rows]
        target_logits = model.compute_logits(sample)

        def step0(args=args):   # the proposer's step 0: fc, the model over the scheduled tokens, the logits
            fed_again = model.combine_hidden_states(aux_dt)
            out = forward(*args[:2], fed_again[rows] if len(chunks) == 1 else args[2], *args[3:])[0]
            return model.compute_logits(out[sample_rows])
        loaded.passes.append(step0)
        draft_logits = loaded.recorder.take().get("logits") if record else None
        st["target_ids"] = target_logits.argmax(-1)
        st["draft_ids"] = draft_ids(model, target_logits)
        if record:
            st["logits"] = first(draft_logits)
        out_steps.append(st)
        out_rows.append({"logits": last, "draft_ids": last, "target_ids": last})

        # Steps >= 1: one query per request (its last token), positions + 1, seq_lens + 1 (:683-760).
        hidden = st["recurrent_hidden"][last]
        prev = st["target_ids"]
        pos = positions[last].long()
        for k in range(1, steps):
            tok = next_ids[last, k - 1] if next_ids is not None else prev
            pos = pos + 1
            seq_lens = [n + k for n in lengths]
            slot_map = slots(torch.arange(B), torch.tensor(lengths) + k - 1)
            args = (tok.int(), pos, hidden, [1] * B, seq_lens, slot_map)
            last_hidden, aux_out, seen = forward(*args)
            loaded.passes.append(lambda args=args: model.compute_logits(forward(*args)[0]))
            st = canonical(loaded, seen, tok, hidden, aux_out) if record else {"recurrent_hidden": aux_out}
            target_logits = model.compute_logits(last_hidden)
            if record:
                st["logits"] = first(loaded.recorder.take()["logits"])
            st["target_ids"] = target_logits.argmax(-1)
            st["draft_ids"] = draft_ids(model, target_logits)
            out_steps.append(st)
            out_rows.append({name: last for name in st})
            hidden, prev = aux_out, st["target_ids"]

    tensors = {f"{k}/{name}": v.contiguous().clone() for k, st in enumerate(out_steps) for name, v in st.items()}
    save_file(tensors, req["out"])
    notes = [f"vLLM {vllm.__version__} Eagle3LlamaForCausalLM via EngineArgs -> get_model (its proposer's loader); "
             f"attention backend {loaded.backend.get_name()}",
             "step 0: the model over every token of each request" + (f" in two chunks (cached prefix {prefix})"
                                                                      if any(prefix) else "")
             + "; steps >= 1: one query per request on its last token, as the proposer's draft loop",
             *loaded.shared, *(f"shim: {s}" for s in shims.APPLIED)]
    return {"rows": [{n: r.tolist() for n, r in rows.items()} for rows in out_rows], "notes": notes}


def replay(req: dict) -> dict:
    """Draft step `step`'s bare pass of the handle's last run again, `rounds` times, each timed here (no pipe,
    no file, no hook: what a benchmark compares). A pass rewrites the same KV slots with the same values.
    Step 0: combine_hidden_states, the model over every token, compute_logits on the last ones; step k >= 1:
    the model on one query per request and compute_logits (llm_base_proposer.py:549-614, :683-760)."""
    loaded: Loaded = STATE["loaded"][req["handle"]]
    call = loaded.passes[req["step"]]
    hooks = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in loaded.model.modules()]
    for m, _, _ in hooks:   # detached while timed (the Recorder's and the accounting's hooks)
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    seconds = []
    try:
        with torch.no_grad():
            for _ in range(req["rounds"]):
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
    finally:
        for m, pre, post in hooks:
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.update(post)
    return {"pass_seconds": seconds}


def draft_ids(model, target_logits):
    """The draft-vocab id behind each target id compute_logits' argmax picked (the inverse of its scatter)."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    target = target_logits.argmax(-1)
    if d2t is None:
        return target
    base = torch.arange(d2t.shape[0]) + d2t
    return (base.unsqueeze(0) == target.unsqueeze(1)).int().argmax(-1)


# ---------------------------------------------------------------- target-side wiring: the aux ids vLLM's runner passes

def aux_layers(req: dict) -> dict:
    """The aux layer ids vLLM's model runner `req["runner"]` hands the target for this draft config (no weights
    are read): vLLM's config path (EngineArgs -> create_engine_config, with its speculators-format translator),
    then that runner's reading (runner_aux_layers) on that config, else the target's
    get_eagle3_default_aux_hidden_state_layers (model_executor/models/interfaces.py:1751-1772; DeepSeek-V2/V3:
    deepseek_v2.py:1958-1960) for its number of layers. All are vLLM's own functions, called on stand-ins that
    hold only what they read (the speculative config; the target's layer list). Also what keeps vLLM off its V2
    runner for this config (config/vllm.py:3053-3087; empty: a server with Triton runs V2)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.interfaces import SupportsEagle3

    target = json.loads(Path(req["target"]).read_text())
    vllm_config = engine_config(Path(req["draft"]), "float32", 1, Path(req["work"]), target)
    spec = vllm_config.speculative_config
    ids = runner_aux_layers(req["runner"], spec)
    text = target.get("text_config", target)
    layers = SimpleNamespace(model=SimpleNamespace(layers=[None] * text["num_hidden_layers"]))
    default = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(layers)
    return {"ids": None if ids is None else list(ids), "default": list(default),
            "reading": draft_config_reading(spec.draft_model_config.hf_config),
            "v2_unsupported": list(vllm_config._get_v2_model_runner_unsupported_features())}


def runner_aux_layers(runner: str, spec):
    """The aux ids a model runner reads from the draft config, by that runner's own function: V1
    GPUModelRunner._get_eagle3_aux_layers_from_config (v1/worker/gpu_model_runner.py:5190-5221: the top-level
    key, else eagle_config's), V2 get_eagle3_aux_layers_from_config (v1/worker/gpu/spec_decode/eagle/
    eagle3_utils.py:116-152: the top-level key, else eagle_config's `layer_ids`, never its
    eagle_aux_hidden_state_layer_ids). None: the target's default."""
    from types import SimpleNamespace

    if runner == "v2":
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        return get_eagle3_aux_layers_from_config(spec)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))


def capture(req: dict) -> dict:
    """The target's capture observed: vLLM's target class for this config built by get_model (random weights:
    load_format "dummy"; the capture does not depend on them), its aux layers set as GPUModelRunner.
    _setup_eagle3_aux_hidden_state_outputs does (the config's ids, else the class's default; :5169-5188), one
    forward over a request, and each aux state it returns matched exactly to the residual stream entering a
    decoder layer (boundary i) or the final norm (boundary N). A class that does not run here (no CPU path for its
    attention) answers `ran: False` with vLLM's own words."""
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
        if vllm_config.model_config.use_mla and shims.APPLIED:
            raise NotImplementedError(f"{type(model).__name__} uses MLA attention: vLLM's CPU MLA backend calls its "
                                      "CPU build's compiled ops (v1/attention/backends/mla/cpu_mla.py:180), absent "
                                      "from the CUDA wheel, and FLEX_ATTENTION (the shim's) is not an MLA backend")
    except Exception as exc:   # vLLM's own words: this class cannot be built here
        traceback.print_exc()
        return {"ran": False, "why": f"{type(exc).__name__}: {first_line(exc)}"}
    T = 6
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.get_text_config().vocab_size, (T,), generator=generator)
    positions = torch.arange(T)
    specs = kv_cache(holder, 2)
    vllm_config.cache_config.num_gpu_blocks = 2
    block_table = torch.ones(1, 1, dtype=torch.int32)   # block 1: block 0 is the null block
    slot_map = BLOCK_SIZE + torch.arange(T)
    qsl = torch.tensor([0, T], dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor([T], dtype=torch.int32),
        num_reqs=1, num_actual_tokens=T, max_query_len=T, max_seq_len=T, block_table_tensor=block_table,
        slot_mapping=slot_map, causal=True, positions=positions)
    names = [a.layer_name for a in attn]
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
    except Exception as exc:   # the capture itself fails (e.g. a None residual): vLLM's own words
        traceback.print_exc()
        return {"ran": True, "ids": list(ids), "served": None, "error": f"{type(exc).__name__}: {first_line(exc)}",
                "architecture": type(model).__name__}
    finally:
        for h in handles:
            h.remove()
    aux = out[1] if isinstance(out, tuple) else []
    served = []
    for state in aux:
        same = [b for b, s in sorted(streams.items()) if s.shape == state.shape and torch.equal(s, state)]
        served.append(same[0] if len(same) == 1 else -1)   # -1: no single boundary holds exactly this state
    return {"ran": True, "ids": list(ids), "served": served, "error": "", "architecture": type(model).__name__}


# ---------------------------------------------------------------- the loop

def serve() -> None:
    applied = shims.install()
    ready = {"ok": True, "vllm": vllm.__version__, "torch": torch.__version__, "shims": applied,
             "platform": type(__import__("vllm.platforms", fromlist=["current_platform"]).current_platform).__name__}
    _PROTOCOL.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.time()
        try:
            if req["op"] == "quit":
                break
            for handle in req.get("drop", ()):   # drafts the adapter no longer holds
                STATE["loaded"].pop(handle, None)
            answer = {"load": load, "account": account, "run": run, "replay": replay, "ran": ran,
                      "aux_layers": aux_layers, "capture": capture}[req["op"]](req)
            answer = {"ok": True, **answer}
        except Exception as exc:   # vLLM's own words, one line; the traceback to stderr
            traceback.print_exc()
            answer = {"ok": False, "error": type(exc).__name__, "message": first_line(exc)}
        answer["seconds"] = round(time.time() - t0, 3)
        print(f"[worker] {req['op']} {answer['seconds']}s ok={answer['ok']}", file=sys.stderr, flush=True)
        _PROTOCOL.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    serve()
