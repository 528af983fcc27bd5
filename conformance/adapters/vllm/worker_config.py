"""The worker's vLLM configuration (part of worker.py, in vLLM's environment): the harness's tiny target
config.json, vLLM's EngineArgs -> create_engine_config over it with the draft as its speculative model, the
process's distributed groups, and what vLLM read from the draft's config. vLLM is imported where it is used, so
that this file imports without it (conformance/meta/test_vllm_worker.py)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

TARGET_LAYERS = 8          # the tiny target's depth; aux ids (2, 4, 5) are inputs of its layers
BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_DISTRIBUTED = {"ready": False}   # vLLM's process groups, set up once per process


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
    if _DISTRIBUTED["ready"]:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    init_file = Path(tempfile.mkdtemp(prefix="vllm-gloo-")) / "init"
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    _DISTRIBUTED["ready"] = True


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
