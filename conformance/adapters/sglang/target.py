"""SGLang's real target model classes with EAGLE-3 aux capture, in-process on CPU, without a server.

What SGLang's model runner does for an EAGLE-3 draft, each step through SGLang's own function: read
the aux-layer ids from the draft's config.json (`resolve_spec_aux_hidden_state_config`), hand them
to the target (`configure_aux_hidden_state_capture` -> the class's `set_eagle3_layers_to_capture`),
run the target with capture_hidden_mode FULL and take `LogitsProcessorOutput.hidden_states`: the
concatenated aux tensor the draft is fed (running-real-implementations.md, "SGLang's target models").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from conformance.adapters.sglang import compat
from conformance.adapters.sglang.runtime import ATTENTION_BACKEND, ensure_runtime
from conformance.core.common import first_line
from fixtures.targets import TargetSpec


class SGLangRaised(Exception):
    """SGLang's own code raised: the message is one line, `error` the class of what SGLang raised (what a
    registry wiring entry of an error kind matches, with its message)."""

    def __init__(self, message: str, error: str):
        super().__init__(message)
        self.error = error


class DraftConfigRefused(SGLangRaised):
    """SGLang's own reader refused the draft's config.json."""


class CaptureFailed(SGLangRaised):
    """SGLang's target forward raised while capturing."""


def one_line(exc: BaseException, *strip: str) -> str:
    """`Type: first line of the message`, with the given path prefixes removed (no temp paths in reports)."""
    text = first_line(exc)
    for prefix in strip:
        text = text.replace(prefix.rstrip("/") + "/", "")
    return f"{type(exc).__name__}: {text}"


@dataclass(frozen=True)
class AuxIds:
    """What SGLang's model runner resolved from a draft config (SpecAuxHiddenStateConfig fields)."""

    use_aux: bool
    layer_ids: tuple[int, ...] | None   # None: SGLang found no ids and the target uses its default list


def sglang_aux_layer_ids(draft_dir: Path, root: Path | None = None) -> AuxIds:
    """The aux-layer ids SGLang's model runner hands the target for this draft directory.

    SGLang's own resolution (`resolve_spec_aux_hidden_state_config`, model_runner.py:597-604), under
    SGLang's scoped test override of the published server arguments (runtime_context.py:1177-1184:
    a speculative EAGLE3 server whose draft is `draft_dir`); the previous arguments are restored.
    Raises DraftConfigRefused (one line, paths relative to `root`) when SGLang cannot read the config.
    """
    ensure_runtime()
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    # model_config is the target's; with a draft path SGLang never reads it (spec_aux_hidden_state.py:171).
    try:
        with get_context().override_server_args(speculative_algorithm="EAGLE3",
                                                speculative_draft_model_path=str(draft_dir)) as server_args:
            resolved = resolve_spec_aux_hidden_state_config(
                server_args=server_args, model_config=None, spec_algorithm=SpeculativeAlgorithm.EAGLE3,
                is_draft_worker=False)
    except Exception as exc:  # SGLang's reader: keep its own words, on one line
        raise DraftConfigRefused(one_line(exc, *(str(p) for p in (root, draft_dir) if p)),
                                type(exc).__name__) from None
    ids = resolved.eagle_aux_hidden_state_layer_ids
    return AuxIds(bool(resolved.eagle_use_aux_hidden_state), None if ids is None else tuple(int(i) for i in ids))


def sglang_class(spec: TargetSpec):
    module, name = spec.sglang_class.split(":")
    return getattr(importlib.import_module(module), name)


def build_target(spec: TargetSpec, config_dir: Path) -> "SGLangTarget":
    """SGLang's class for `spec`, built in fp32 from SGLang's ModelConfig of `config_dir` (no weights yet).

    It lives on the device SGLang chose its kernels for (ensure_runtime: the CPU here; results come
    back on the CPU either way)."""
    device = ensure_runtime()["device"]
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    # ModelConfig is how a server reads the target (it also sets the wrapper flags Kimi-K2.5 reads,
    # model_config.py:908-909); the model is built from its hf_config, as the model loader does.
    model_config = ModelConfig(str(config_dir), dtype="float32")
    # Forked: some classes initialise modules from the global generator (Kimi-K2.5's vision tower), which
    # other tests may draw from; the weights that matter are loaded afterwards.
    with set_default_torch_dtype(torch.float32), torch.device(device), torch.random.fork_rng(devices=[]):
        return SGLangTarget(spec, sglang_class(spec)(model_config.hf_config).eval(), device)


def load_target(spec: TargetSpec, config_dir: Path, weights: dict[str, torch.Tensor]) -> "SGLangTarget":
    """build_target, then the HF-named weights through the class's own load_weights."""
    target = build_target(spec, config_dir)
    target.model.load_weights((spec.weight_prefix + name, w.clone()) for name, w in weights.items())
    return target


class SGLangTarget:
    def __init__(self, spec: TargetSpec, model, device: str = "cpu"):
        self.spec, self.model, self.device = spec, model, device

    @property
    def text(self) -> dict:
        """The text model's config; read when a forward needs it, so that a class built only for its
        capture settings (settings.served_aux_layers) needs no fixture config."""
        return self.spec.text_config

    @property
    def layers_to_capture(self) -> list[int]:
        inner = self.model.language_model if hasattr(self.model, "language_model") else self.model
        return list(inner.model.layers_to_capture)

    def set_capture(self, aux: AuxIds) -> None:
        """SGLang's own step between resolution and forward (attention_backend_setup.py:40-61)."""
        from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
            configure_aux_hidden_state_capture,
        )

        configure_aux_hidden_state_capture(model=self.model, eagle_use_aux_hidden_state=aux.use_aux,
                                           eagle_aux_hidden_state_layer_ids=list(aux.layer_ids) if aux.layer_ids
                                           is not None else None, dflash_use_aux_hidden_state=False,
                                           dflash_target_layer_ids=None, is_dspark=False)

    def _backend(self, tokens: int):
        """Request and KV pools for one request of `tokens` tokens (row 0 / slot 0 are padding)."""
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

        t, n, device = self.text, self.text["num_hidden_layers"], self.device
        req_to_token = ReqToTokenPool(size=1, max_context_len=tokens, device=device, enable_memory_saver=False)
        req_to_token.req_to_token[1, :tokens] = torch.arange(1, tokens + 1, dtype=torch.int32)
        if self.spec.kv == "mla":
            kv = MLATokenToKVPool(size=tokens + 1, page_size=1, dtype=torch.float32, kv_lora_rank=t["kv_lora_rank"],
                                  qk_rope_head_dim=t["qk_rope_head_dim"], layer_num=n, device=device,
                                  enable_memory_saver=False)
        else:
            # Under tensor parallelism a rank caches its own KV heads: SGLang's ModelConfig.get_num_kv_heads.
            from sglang.srt.distributed.parallel_state import get_tp_group

            heads = max(1, t["num_key_value_heads"] // get_tp_group().world_size)
            kv = MHATokenToKVPool(size=tokens + 1, page_size=1, dtype=torch.float32,
                                  head_num=heads, head_dim=t["head_dim"], layer_num=n,
                                  device=device, enable_memory_saver=False, enable_alt_stream=False)
        # The torch_native backend reads only these three fields of a ModelRunner.
        runner = SimpleNamespace(device=device, req_to_token_pool=req_to_token, token_to_kv_pool=kv)
        return ATTENTION_BACKENDS[ATTENTION_BACKEND](runner)

    def _pass(self, backend, input_ids: torch.Tensor, start: int, end: int, decode: bool):
        """One forward over tokens [start, end) of the request, the first `start` already in the KV cache."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext

        n, on = end - start, dict(device=self.device)
        seq_lens = torch.tensor([end], **on)
        extend = {} if decode else dict(
            extend_num_tokens=n, extend_seq_lens=torch.tensor([n], dtype=torch.int32, **on),
            extend_prefix_lens=torch.tensor([start], dtype=torch.int32, **on),
            extend_start_loc=torch.zeros(1, dtype=torch.int32, **on), extend_seq_lens_cpu=[n],
            extend_prefix_lens_cpu=[start])
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=1,
            input_ids=input_ids[start:end].to(self.device), req_pool_indices=torch.tensor([1], **on),
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(), out_cache_loc=torch.arange(start + 1, end + 1, **on),
            seq_lens_sum=end, positions=torch.arange(start, end, **on), capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=None, **extend)
        with torch.no_grad(), compat.forward_context(ForwardContext(attn_backend=backend), fb):
            backend.init_forward_metadata(fb)
            return self.model.forward(fb.input_ids, fb.positions, fb)

    def run(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, k*Ht] as SGLang hands it to the draft, last-token logits [1, V]); raises CaptureFailed.

        MLA targets: the first token as a DECODE step, the rest as an EXTEND over that cached token.
        On CPU only torch_native runs, and its MLA EXTEND without a cached prefix re-reads the latent
        cache on the MHA path and fails (running-real-implementations.md); this takes the absorbed-MLA
        path instead. The capture itself is the same code in both modes.
        """
        T = input_ids.shape[0]
        backend = self._backend(T)
        splits = [(0, 1, True), (1, T, False)] if self.spec.kv == "mla" else [(0, T, False)]
        outs = []
        try:
            for start, end, decode in splits:
                outs.append(self._pass(backend, input_ids, start, end, decode))
        except Exception as exc:  # SGLang's own forward: keep its words, on one line
            raise CaptureFailed(one_line(exc), type(exc).__name__) from None
        return torch.cat([o.hidden_states for o in outs]).cpu(), outs[-1].next_token_logits.cpu()

    def notes(self) -> list[str]:
        passes = "DECODE of token 0, then EXTEND over a cached prefix of 1" if self.spec.kv == "mla" else "one EXTEND"
        return [f"{self.spec.sglang_class} fp32, attention backend {ATTENTION_BACKEND}, {passes}",
                "ids via resolve_spec_aux_hidden_state_config; capture set via configure_aux_hidden_state_capture"]
