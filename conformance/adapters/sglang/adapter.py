"""SGLang's real EAGLE-3 draft (`LlamaForCausalLMEagle3`) run in-process (CPU, or CUDA), stage by stage.

Step 0 is SGLang's draft EXTEND over every packed sequence; steps >= 1 are SGLang's draft DECODE
passes on each request's last token, as in serving (drafting.py). Stages are observed with forward
hooks on SGLang's own modules and mapped to the canonical layout (recorder.py,
running-real-implementations.md); the runtime it needs is set up once per process (runtime.py).
"""
from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from conformance.adapters.base import AdapterBase, Drafter, TimedPass, chain_drafter

from conformance.core.trace import Trace
from conformance.adapters.sglang import drafting, engine, engine_cuda, mla, settings, target, tensor_parallel, weights
from conformance.adapters.sglang.draft_model import NAME, load_model
from conformance.adapters.sglang.recorder import Recorder, canonical_stages
from conformance.adapters.sglang.runtime import attention_backend, ensure_runtime, forward_batch_on, forward_pass
from conformance.checkpoints.formats import sglang_mla
from conformance.core import stages
from conformance.loading.accounting import Accounting
from reference.eagle3 import DraftBatch, Eagle3Config

# What a benchmark times, per step: one of SGLang's passes alone, replayed on its own pools.
TIMED = ("one draft EXTEND pass: init_forward_metadata + LlamaForCausalLMEagle3.forward, B requests of L tokens",
         "one draft DECODE pass (step 1): init_forward_metadata + forward, B queries over B*(L+1) cached keys")


class SGLangAdapter(AdapterBase):
    name: ClassVar[str] = NAME
    package: ClassVar[str | None] = "sglang"
    checkpoint_format: ClassVar[str] = "sglang"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST)
    draft_group: ClassVar[int | None] = None   # its attention runs per request: grouping gains nothing
    serving_decode: ClassVar[bool] = True
    is_server: ClassVar[bool] = True
    default_server: ClassVar[bool] = True   # it runs in-process here: its target classes, settings, tree and engine
    target_capture: ClassVar[ModuleType | None] = target     # its target classes, fed the ids it reads from a draft
    server_settings: ClassVar[ModuleType | None] = settings  # --sglang-args through SGLang's own ServerArgs
    engine: ClassVar[ModuleType | None] = engine             # SGLang's real Engine (the engine lane)
    engine_cuda: ClassVar[ModuleType | None] = engine_cuda   # the same Engine on a CUDA runner (make engine-gpu)
    tensor_parallel: ClassVar[ModuleType | None] = tensor_parallel   # target and draft over gloo ranks (TP)
    mla: ClassVar[ModuleType | None] = mla                   # its MLA draft class, for a user's MLA draft
    releases: ClassVar[tuple[str, ...]] = ("0.5.20", "0.5.21", "0.5.22", "0.5.23")   # differences: compat.py
    mla_releases: ClassVar[tuple[str, ...]] = ("0.5.23",)   # where its MLA draft class was run (mla.py)
    silent_drop: ClassVar[str | None] = ("load_weights loads a tensor only `if param_name in params_dict` "
                                         "(sglang/srt/models/llama_eagle3.py:363, 373) and skips the rest "
                                         "without a word")

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        # Knobs SGLang ignores (norm_before_residual, q/k/v bias, ...) are divergences for the
        # suite to catch, not reasons to skip.
        if cfg.hidden_act != "silu":
            return f"SGLang's draft MLP (LlamaMLP) only supports silu, not {cfg.hidden_act!r}"
        if cfg.draft_arch == "mla":
            from conformance.core import registry   # the release the matrix is evaluated at (support_matrix)

            release = registry.installed_version(self.package)
            if release not in self.mla_releases:
                return (f"SGLang's MLA draft (Eagle3DeepseekV2ForCausalLM, models/kimi_k25_eagle3.py) is run on "
                        f"{', '.join(self.mla_releases)} only, not on {release}")
        return None

    def format_for(self, cfg: Eagle3Config) -> str:
        # An MLA draft is SGLang's other EAGLE-3 class, with a format of its own (kimi_k25_eagle3.py).
        return sglang_mla.NAME if cfg.draft_arch == "mla" else self.checkpoint_format

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        # fc only when the aux states are not hidden_size wide (llama_eagle3.py:238).
        return cfg.num_aux_hidden_states * cfg.target_hidden_size != cfg.hidden_size

    def dense_attention(self, device: str) -> bool:
        return False   # paged attention per request over the KV pool

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedSGLang":
        """`server_args`: SGLang speculative server flags by ServerArgs field name (e.g.
        speculative_draft_window_size), applied through SGLang's own scoped config override while
        the model is built, which is when LlamaForCausalLMEagle3 reads them (llama_eagle3.py:288-299)."""
        model = load_model(ckpt_dir, dtype, server_args, device)
        if type(model).__name__ == sglang_mla.ARCHITECTURE:
            if device != "cpu":   # mla_chain builds its pools and backend on the runtime's device only
                raise ValueError(f"sglang: the MLA draft runs on the CPU here, asked for {device!r}")
            return mla.LoadedMLA(model, dtype)
        return LoadedSGLang(model, dtype, ensure_runtime(), device, Path(ckpt_dir))

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
        from conformance.checkpoints import detect_format

        if detect_format(Path(ckpt_dir)) == sglang_mla.NAME:
            return mla.account(Path(ckpt_dir), dtype)
        return weights.account(self, Path(ckpt_dir), dtype, target)


class LoadedSGLang:
    def __init__(self, model, dtype: torch.dtype, runtime: dict, device: str = "cpu", model_dir: Path | None = None):
        self.model = model
        self.model_dir = model_dir   # SGLang's ModelConfig is read from it for a GPU attention backend
        self.dtype = dtype
        self.runtime = runtime
        self.device = device
        self.attention_backend = attention_backend(device)
        self.recorder = Recorder(model)
        # SGLang shares a RotaryEmbedding between models (get_rope's cache): the hooks on it would keep
        # every loaded model alive, so they go when this LoadedSGLang does.
        weakref.finalize(self, self.recorder.detach)
        self.passes: list = []   # (backend, ForwardBatch) of each forward pass of the last run()
        attn0 = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.hot_token_id = model.get_hot_token_id()

    # ------------------------------------------------------------ the draft

    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """`record=False`: the stage hooks are detached (a benchmark's set-up); the trace then holds
        only what the passes return (recurrent_hidden, logits, draft_ids, target_ids)."""
        if record:
            return drafting.chain(self, batch, steps)
        with self.hooks_detached():
            return drafting.chain(self, batch, steps)

    def run_tree(self, batch: DraftBatch, steps: int, topk: int, num_draft_tokens: int) -> Trace:
        """SGLang's EAGLE tree draft (drafting.tree; conformance/draft/test_tree.py)."""
        return drafting.tree(self, batch, steps, topk, num_draft_tokens)

    def drafter(self) -> Drafter:
        return chain_drafter(self)

    # ------------------------------------------------------------ what the drafting loops use

    def forward(self, backend, fb):
        """One pass, recorded for replay; returns (its output, what the stage hooks saw)."""
        if self.device != "cpu":
            fb = forward_batch_on(fb, self.device)
        translator = getattr(backend, "kv_index_translator", None)
        if translator is not None:   # Triton reads KV ids through a plan, as ForwardBatch.init_new binds it
            translator.bind_own_plan(fb)
        self.passes.append((backend, fb))
        self.recorder.take()
        out = forward_pass(self.model, backend, fb)
        return out, self.recorder.take()

    def stages(self, seen: dict, spec_hidden: torch.Tensor, input_ids: torch.Tensor, out, aux_in: bool) -> dict:
        return canonical_stages(self, seen, spec_hidden, input_ids, out, aux_in)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # SGLang maps draft-vocab ids through hot_token_id (d2t + arange), as the EAGLE worker does.
        return draft_ids if self.hot_token_id is None else self.hot_token_id[draft_ids]

    def trace(self, steps: list[dict], rows: list[dict], notes: list[str]) -> Trace:
        return Trace(impl=SGLangAdapter.name, dtype=self.dtype, steps=steps, rows=rows, notes=notes,
                     claimed_stages=SGLangAdapter.claimed_stages, num_layers=len(self.model.model.layers))

    # ------------------------------------------------------------ timing (benchmarks)

    @contextlib.contextmanager
    def timed_pass(self, batch: DraftBatch, step: int):
        """Pass `step` of a two-step run (EXTEND, then DECODE step 1) replayed alone, hooks detached.
        The run sets up pools, KV cache and ForwardBatches once; the benchmark batch has no cached
        prefix, so the EXTEND is one pass and `passes[step]` is the asked one."""
        self.run(batch, steps=2, record=False)
        with self.hooks_detached():
            yield TimedPass(lambda: self.replay_pass(step), (step,), TIMED[step])

    @contextlib.contextmanager
    def hooks_detached(self):
        """No stage hooks inside (they clone every stage): what a benchmark times is the bare pass."""
        self.recorder.detach()
        try:
            yield
        finally:
            self.recorder.attach()

    def replay_pass(self, index: int):
        """Forward pass `index` of the last run() again, on its own pools and ForwardBatch: SGLang's
        EXTEND (0) or DECODE (k >= 1) pass alone. A pass rewrites the same KV slots with the same
        values, so replaying it changes nothing (conformance/meta/test_lanes.py checks that)."""
        backend, fb = self.passes[index]
        return forward_pass(self.model, backend, fb)
