"""The draft's model as SGLang builds and loads it: its class resolved from the directory's `architectures` as SGLang's
model runner does, built from config.json, loaded through its own `load_weights`. Used by the adapter (its
forward) and by the weight accounting (weights.py), neither importing the other."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from conformance.adapters.sglang.runtime import ensure_runtime
from conformance.checkpoints import weight_files

NAME = "sglang"   # the adapter's name (SGLangAdapter.name), for what this module reports


def load_model(ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None, device: str = "cpu"):
    """The draft's model class as SGLang resolves it, built from the directory's config.json and loaded through
    its own `load_weights` (any EAGLE-3 class: the Llama one, or the MLA `Eagle3DeepseekV2ForCausalLM`)."""
    runtime = ensure_runtime()
    if torch.device(device).type != runtime["device"]:
        raise ValueError(f"sglang: asked for device {device!r}, but SGLang chose its kernels for "
                         f"{runtime['device']!r} on this host (is_cuda() at import)")
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.utils.hf_transformers.config import get_config

    # SGLang's config path, minus its per-process cache (keyed by path only: a directory
    # rewritten between tests would return a stale config); the model also writes into it.
    config = get_config.__wrapped__(str(ckpt_dir), trust_remote_code=False)
    model_class = draft_class(ckpt_dir, config)
    with set_default_torch_dtype(dtype), get_spec().override(**(server_args or {})), torch.device(device), \
            serving_mla_rope(runtime["device"]):
        model = model_class(config).eval()
    # SGLang's loader reads every weight file the directory has (a shard index too, as NeMo writes it).
    model.load_weights(safetensors_weights_iterator([str(p) for p in weight_files(Path(ckpt_dir))]))
    return model


def draft_class(ckpt_dir: Path, config):
    """The draft's model class as SGLang's model runner resolves it from `architectures`
    (model_loader/utils.py:198-234 get_model_architecture on the draft's ModelConfig): its own EAGLE-3 class by
    that name at once (models/registry.py:97-103); any other name goes through SGLang's resolution, which refuses
    a name neither SGLang nor transformers registers (model_loader/utils.py:155-161), e.g. NeMo Automodel's
    LlamaEagle3DraftModel. Only an other name pays for that resolution (it imports every SGLang model module)."""
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    if list(getattr(config, "architectures", None) or []) == [LlamaForCausalLMEagle3.__name__]:
        return LlamaForCausalLMEagle3
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    model_config = ModelConfig(str(ckpt_dir), is_draft_model=True, speculative_algorithm="EAGLE3",
                               trust_remote_code=False)
    with warnings.catch_warnings():   # importing its model modules: "Triton is not supported on current platform"
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        return get_model_architecture(model_config)[0]


@contextlib.contextmanager
def serving_mla_rope(device: str):
    """On a CPU host, DeepSeek's MLA attention (the MLA draft's, models/deepseek_v2.py:2165-2175) builds its rope
    through SGLang's CPU factory, which asserts on a rope without scaling (layers/rotary_embedding/factory.py:478):
    a plain-RoPE MLA draft would not even build. Inside, that one call gets SGLang's serving factory instead, the
    one get_rope_wrapper takes on a CUDA server (factory.py:527-538: get_rope; a plain RotaryEmbedding, whose own
    forward_native runs here as the Llama draft's, runtime.cpu_runtime_adjustments). A scaled rope keeps the CPU
    factory (deepseek_yarn: the same DeepseekScalingRotaryEmbedding). Nothing changes on a CUDA host."""
    if device != "cpu":
        yield
        return
    from sglang.srt.models import deepseek_v2

    cpu_wrapper = deepseek_v2.get_rope_wrapper

    def serving_wrapper(*args, rope_scaling=None, device=None, **kwargs):
        served = "cpu" if rope_scaling else "cuda"   # any non-CPU device: get_rope, as served
        return cpu_wrapper(*args, rope_scaling=rope_scaling, device=served, **kwargs)
    deepseek_v2.get_rope_wrapper = serving_wrapper
    try:
        yield
    finally:
        deepseek_v2.get_rope_wrapper = cpu_wrapper
