"""The engine lane's adjustment for SGLang's MLA draft on a CPU host (engine_shims.platform_calls_in_mla_set_embed).

When the worker shares the target's embedding with the draft (eagle_worker_v2.py:363), Eagle3DeepseekV2ForCausalLM's
set_embed ends in torch.cuda.synchronize() (kimi_k25_eagle3.py:404-423), which raises on a host without a CUDA driver;
the Llama draft's calls SGLang's current_platform instead. Shown on the loaded draft: without the adjustment the call
fails (its plant), with it the target's embedding is shared exactly as SGLang's code shares it.
"""
from __future__ import annotations

import pytest
import torch

from fixtures.mla import make_mla_config, make_mla_weights, write_mla_checkpoint

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


@pytest.fixture
def mla_draft(tmp_path, monkeypatch):
    """A loaded MLA draft (H = Ht: set_embed shares the embedding); SGLang's class restored after the test."""
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM

    from conformance.adapters.sglang.mla import load

    for name in ("set_embed", "set_embed_and_head"):
        monkeypatch.setattr(Eagle3DeepseekV2ForCausalLM, name, getattr(Eagle3DeepseekV2ForCausalLM, name))
    cfg = make_mla_config()
    write_mla_checkpoint(tmp_path / "draft", cfg, make_mla_weights(cfg, torch.Generator().manual_seed(5)))
    return load(tmp_path / "draft", torch.float32)


def test_the_mla_draft_shares_the_target_embedding_on_a_cpu_host(mla_draft):
    from conformance.adapters.sglang.engine_shims import platform_calls_in_mla_set_embed

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: SGLang's torch.cuda calls run as written, the adjustment changes nothing")
    def embedding():
        return torch.nn.Parameter(torch.randn_like(mla_draft.model.embed_tokens.weight), requires_grad=False)
    with pytest.raises(RuntimeError, match="NVIDIA driver"):   # SGLang's own code, unadjusted
        mla_draft.set_embed(embedding())
    assert platform_calls_in_mla_set_embed() == "torch.cuda.empty_cache/synchronize -> current_platform's"
    assert platform_calls_in_mla_set_embed().endswith("(already)")
    target_embed = embedding()
    mla_draft.set_embed(target_embed)
    assert mla_draft.model.embed_tokens.weight is target_embed
