"""SGLang's real EAGLE-3 draft (`LlamaForCausalLMEagle3`) run in-process (CPU, or CUDA), stage by stage.

Step 0 is SGLang's draft EXTEND over every packed sequence; steps >= 1 are SGLang's draft DECODE
passes on each sequence's last token, as in serving. Stages are observed with forward hooks on
SGLang's own modules and mapped to the canonical layout (running-real-implementations.md).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch

from conformance.core import stages
from conformance.adapters.base import Trace
from reference.eagle3 import DraftBatch, Eagle3Config

ATTENTION_BACKEND = "torch_native"
# On CUDA: SGLang's Triton attention, the GPU backend that needs no extra package (triton ships with
# torch; flashinfer and fa3 are separate CUDA builds).
GPU_ATTENTION_BACKEND = "triton"
WEIGHTS_FILE = "model.safetensors"
INIT_METHOD = "tcp://127.0.0.1:0"


def cpu_runtime_adjustments() -> dict[str, tuple[object, object]]:
    """The one runtime adjustment SGLang needs on a plain CPU host; returns {what: (before, after)}.

    `RotaryEmbedding.__init__` treats an unknown platform as "not CUDA, not CPU" and imports
    `vllm._custom_ops` for a fallback kernel. SGLang's official switch (`SGLANG_USE_CPU_ENGINE=1`)
    would set this module's `_is_cpu` flag, but it also makes the KV-cache module import the CPU
    build of sgl-kernel, which is not installable. Setting only the flag (what the switch would set
    for this module) makes the rotary embedding dispatch to SGLang's own `forward_native`.
    """
    from sglang.srt.layers.rotary_embedding import base as rope_base

    before = rope_base._is_cpu
    rope_base._is_cpu = True
    return {"sglang.srt.layers.rotary_embedding.base._is_cpu": (before, rope_base._is_cpu)}


def eager_tree_helpers():
    """Scope in which SGLang's tree helper runs eagerly: the one adjustment tree drafting needs.

    `select_top_k_tokens` dispatches to `_select_top_k_tokens_later`, which SGLang wraps in
    torch.compile on every host but NPU/XPU (speculative/spec_utils.py:437). On a CPU host that is an
    inductor C++ build, 17-34 s on first use, far over the CPU lane's budget. torch's own switch
    `set_stance("force_eager")` runs the same Python function without compiling it (the math that
    torch.compile must reproduce), only inside this scope (test_tree.py checks both).
    """
    return torch.compiler.set_stance("force_eager")


_RUNTIME: dict | None = None


def ensure_runtime() -> dict:
    """Set up SGLang's per-process runtime once (gloo world of 1, published ServerArgs, model parallel).

    Idempotent: pytest loads many checkpoints in one process, and SGLang's parallel state is global.
    Returns a description of what was set up (the CPU adjustments included).
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # SGLang picks its kernels per host when its modules are imported (is_cuda()), so the device is
    # the host's: CUDA when there is one (SGLang's own CUDA kernels, no adjustment), else the CPU.
    device = runtime_device()
    if device == "cuda" and importlib.util.find_spec("sgl_kernel") is None:
        # Otherwise the first SGLang layer import fails deep inside SGLang with a bare ImportError.
        raise RuntimeError("sglang on CUDA needs its CUDA kernels (the sgl_kernel module): "
                           "pip install --no-deps -r requirements-gpu.lock")
    adjustments = cpu_runtime_adjustments() if device == "cpu" else {}
    # Idempotent inside SGLang. Port 0: the OS picks a free port for this world of one, so
    # parallel processes (pytest-xdist workers, concurrent runs) never collide; no MASTER_* env.
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=INIT_METHOD)
    if not model_parallel_is_initialized():
        reset_context()
        # model_path "dummy" is SGLang's own "no model" value: server-argument resolution then
        # skips reading a model config (the draft's config is read per checkpoint in load()).
        publish(
            ServerArgs(model_path="dummy", device=device, attention_backend=attention_backend(device),
                       tp_size=1, ep_size=1, pp_size=1),
            role="scheduler",
            ranks=SpawnRanks(world_rank=0),
        )
        # reset_context() drops the WORLD handle init_distributed_environment registered.
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    _RUNTIME = {"adjustments": adjustments, "distributed": f"gloo, world 1, {INIT_METHOD}", "device": device}
    return _RUNTIME


def runtime_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def attention_backend(device: str) -> str:
    return ATTENTION_BACKEND if torch.device(device).type == "cpu" else GPU_ATTENTION_BACKEND


class SGLangAdapter:
    name: ClassVar[str] = "sglang"
    checkpoint_format: ClassVar[str] = "sglang"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST)

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        # Knobs SGLang ignores (norm_before_residual, q/k/v bias, ...) are divergences for the
        # suite to catch, not reasons to skip.
        if cfg.hidden_act != "silu":
            return f"SGLang's draft MLP (LlamaMLP) only supports silu, not {cfg.hidden_act!r}"
        return None

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedSGLang":
        """`server_args`: SGLang speculative server flags by ServerArgs field name (e.g.
        speculative_draft_window_size), applied through SGLang's own scoped config override while
        the model is built, which is when LlamaForCausalLMEagle3 reads them (llama_eagle3.py:288-299)."""
        runtime = ensure_runtime()
        if torch.device(device).type != runtime["device"]:
            raise ValueError(f"sglang: asked for device {device!r}, but SGLang chose its kernels for "
                             f"{runtime['device']!r} on this host (is_cuda() at import)")
        from sglang.srt.runtime_context import get_spec
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
        from sglang.srt.utils.hf_transformers.config import get_config

        # SGLang's config path, minus its per-process cache (keyed by path only: a directory
        # rewritten between tests would return a stale config); the model also writes into it.
        config = get_config.__wrapped__(str(ckpt_dir), trust_remote_code=False)
        with set_default_torch_dtype(dtype), get_spec().override(**(server_args or {})), torch.device(device):
            model = LlamaForCausalLMEagle3(config).eval()
        model.load_weights(safetensors_weights_iterator([str(Path(ckpt_dir) / WEIGHTS_FILE)]))
        return LoadedSGLang(model, dtype, runtime, device, Path(ckpt_dir))


class _Recorder:
    """Forward hooks on SGLang's modules (observation only); every tensor cloned at call time.

    Some modules are shared between layers (get_rope caches one RotaryEmbedding per shape), so a
    pre-hook on each decoder layer says which layer is running and calls are keyed by it.
    """

    def __init__(self, model):
        self.seen: dict[str, object] = {}
        self.layer: int | None = None
        inner = model.model
        self._hooks: list = []   # (register method, hook): attach() registers them, detach() removes them

        def enter(i):
            def pre_hook(module, args):
                self.layer = i
            return pre_hook

        def leave(module, args, output):
            self.layer = None

        def keep(name, pick):
            def hook(module, args, output):
                key = name if self.layer is None else f"{self.layer}.{name}"
                self.seen.setdefault(key, _clone(pick(args, output)))
            return hook

        def out(a, o):
            return o

        def arg0(a, o):
            return a[0]

        targets = [(inner.embed_tokens, "embed_tokens", out), (inner.fc, "fc", out), (inner.norm, "norm", out)]
        if inner.input_norm is not None:
            targets.append((inner.input_norm, "input_norm", out))
        for j, norm in enumerate(inner.fc_norm or []):
            targets.append((norm, f"fc_norm.{j}", out))
        for i, layer in enumerate(inner.layers):
            self._hooks += [(layer.register_forward_pre_hook, enter(i)), (layer.register_forward_hook, leave)]
            attn = layer.self_attn
            targets += [
                (layer.hidden_norm, "hidden_norm", out),
                (layer.hidden_norm, "hidden_norm_in", arg0),
                (layer.input_layernorm, "input_layernorm", out),
                (attn.qkv_proj, "qkv_in", arg0),
                (attn.qkv_proj, "qkv", out),
                (attn.rotary_emb, "rotary", out),
                (attn.attn, "attn", out),
                (attn.o_proj, "o_proj", out),
                (layer.post_attention_layernorm, "post_attention_layernorm", out),
                (layer.mlp, "mlp", out),
            ]
        hooked: set[tuple[int, str]] = set()
        for module, name, pick in targets:
            if (id(module), name) not in hooked:   # a shared module is hooked once per name
                hooked.add((id(module), name))
                self._hooks.append((module.register_forward_hook, keep(name, pick)))
        self.attach()

    def attach(self) -> None:
        self.handles = [register(hook) for register, hook in self._hooks]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def take(self) -> dict[str, object]:
        seen, self.seen, self.layer = self.seen, {}, None
        return seen


def _batch_on(fb, device: str):
    """A ForwardBatch with its tensors on `device`; the `*_cpu` host copies stay where SGLang wants them."""
    fb, spec = copy.copy(fb), copy.copy(fb.spec_info)   # shallow: no __post_init__ runs again
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name)
        if isinstance(value, torch.Tensor) and not f.name.endswith("_cpu"):
            setattr(fb, f.name, value.to(device))
    spec.hidden_states = spec.hidden_states.to(device)
    fb.spec_info = spec
    return fb


def _sequence_lengths(batch: DraftBatch) -> list[int]:
    """Tokens per sequence of a packed batch (each sequence is one SGLang request)."""
    seq_ids = batch.seq_ids.tolist()
    lengths = [seq_ids.count(s) for s in dict.fromkeys(seq_ids)]
    if seq_ids != [s for s, n in zip(dict.fromkeys(seq_ids), lengths) for _ in range(n)]:
        raise ValueError("sequences must be contiguous in the packed batch")
    return lengths


def draft_kv_layout(slots: list[torch.Tensor], lengths: list[int], topk: int, steps: int):
    """SGLang's KV layout of a tree draft, for requests whose tokens sit in `slots` (prefix first).

    Returns (out_cache_loc, rows). out_cache_loc: each request's topk*steps slots after its prefix,
    what assign_draft_cache_locs_contiguous copies for the draft to write (eagle_worker_common.py:
    263-300, kernels/ops/speculative/cache_locs.py:43-82); SGLang's per_step_draft_out_cache_loc
    then gives tree row b*topk+r column r. rows[b*topk+r]: what that row reads, request b's prefix
    then column r's slots (the first n + i + 1 at draft pass i): the expanded req_to_token of SGLang's
    CPU draft backend (intel_amx_backend.py:461-487) and the rows generate_draft_decode_kv_indices
    emits on GPU (cache_locs.py:224-268). Those kernels do not run on this host (Triton; sgl_kernel's
    CPU build is not installable), so the layout is filled here; test_tree.py checks it against
    SGLang's Triton kernels run in Triton's interpreter.
    """
    out_cache_loc = torch.cat([sl[n:n + topk * steps] for sl, n in zip(slots, lengths)])
    rows = [torch.cat([sl[:n], sl[n + r * steps:n + (r + 1) * steps]])
            for sl, n in zip(slots, lengths) for r in range(topk)]
    return out_cache_loc, rows


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


class LoadedSGLang:
    def __init__(self, model, dtype: torch.dtype, runtime: dict, device: str = "cpu", model_dir: Path | None = None):
        self.model = model
        self.model_dir = model_dir   # SGLang's ModelConfig is read from it for a GPU attention backend
        self.dtype = dtype
        self.runtime = runtime
        self.device = device
        self.attention_backend = attention_backend(device)
        self.recorder = _Recorder(model)
        self.passes: list = []   # (backend, ForwardBatch) of each forward pass of the last run()
        attn0 = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.hot_token_id = model.get_hot_token_id()

    # ------------------------------------------------------------ SGLang runtime objects

    def _pools(self, lengths: list[int], steps: int):
        """Request and KV pools: request r in row r + 1, its tokens in contiguous slots (row/slot 0 pad)."""
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        per_req = [n + steps - 1 for n in lengths]
        req_to_token_pool = ReqToTokenPool(size=len(lengths), max_context_len=max(per_req),
                                           device=self.device, enable_memory_saver=False)
        kv_pool = MHATokenToKVPool(size=sum(per_req) + 1, page_size=1, dtype=self.dtype,
                                   head_num=self.num_kv_heads, head_dim=self.head_dim,
                                   layer_num=len(self.model.model.layers), device=self.device,
                                   enable_memory_saver=False, enable_alt_stream=False)
        slots, base = [], 1
        for r, n in enumerate(per_req):
            s = torch.arange(base, base + n, dtype=torch.int32)
            req_to_token_pool.req_to_token[r + 1, :n] = s
            slots.append(s.long())
            base += n
        if self.attention_backend == ATTENTION_BACKEND:
            # The torch_native backend reads only these three fields of a ModelRunner.
            runner = SimpleNamespace(device=self.device, req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool)
        else:
            runner = self._gpu_runner(req_to_token_pool, kv_pool)
        return ATTENTION_BACKENDS[self.attention_backend](runner), slots

    def _gpu_runner(self, req_to_token_pool, kv_pool):
        """The ModelRunner fields SGLang's Triton backend reads (its __init__ and the KV-index plan),
        as SGLang's own attention test kit fills them (sglang/test/kits/attention_unittest/
        attention_methods/dense_attention.py, MockModelRunner): this draft's ModelConfig, page size 1."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        allocator = SimpleNamespace(page_size=1, get_kvcache=lambda: kv_pool)
        runner = SimpleNamespace(
            device=self.device, gpu_id=torch.device(self.device).index or 0, page_size=1,
            req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool, token_to_kv_pool_allocator=allocator,
            model_config=ModelConfig(str(self.model_dir)), is_draft_worker=True,
            spec_algorithm=SpeculativeAlgorithm.EAGLE3, sliding_window_size=None, kv_cache_dtype=self.dtype,
            decode_num_tokens_per_req=lambda: 1)
        runner.kv_index_translator = KVIndexTranslator(
            req_to_token=req_to_token_pool.req_to_token, token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=kv_pool, page_size=1, device=self.device, is_draft_worker=True)
        return runner

    def _forward(self, backend, fb):
        if self.device != "cpu":
            fb = _batch_on(fb, self.device)
        translator = getattr(backend, "kv_index_translator", None)
        if translator is not None:   # Triton reads KV ids through a plan, as ForwardBatch.init_new binds it
            translator.bind_own_plan(fb)
        self.passes.append((backend, fb))
        self.recorder.take()
        out = self._pass(backend, fb)
        return out, self.recorder.take()

    def _pass(self, backend, fb):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            backend.init_forward_metadata(fb)
            return self.model.forward(fb.input_ids, fb.positions, fb)

    # ------------------------------------------------------------ timing (benchmarks)

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
        values, so replaying it changes nothing (conformance/throughput/test_throughput.py checks that)."""
        backend, fb = self.passes[index]
        return self._pass(backend, fb)

    # ------------------------------------------------------------ one pass -> canonical stages

    def _stages(self, seen: dict, spec_hidden: torch.Tensor, input_ids: torch.Tensor, out, aux_in: bool) -> dict:
        if not self.recorder.handles:   # run(record=False): only what the pass returns
            return {"recurrent_hidden": out.hidden_states, "logits": out.next_token_logits}
        T, nh, nkv, hd = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # Every hooked module SGLang always calls must have been seen (hooks fire on __call__).
        required = ["embed_tokens", "norm"] + [
            f"{i}.{k}" for i in range(len(self.model.model.layers))
            for k in ("hidden_norm", "qkv", "rotary", "attn", "o_proj", "post_attention_layernorm", "mlp")]
        missing = [k for k in required if k not in seen]
        if missing:
            raise RuntimeError(f"forward hooks did not fire for {missing}")
        s: dict[str, torch.Tensor] = {}
        if aux_in:
            s["aux_in"] = spec_hidden.clone()
        else:   # a draft DECODE pass is fed the previous step's returned hidden (spec_info.hidden_states)
            s["hidden_in"] = spec_hidden.clone()
        if "fc" in seen:  # SGLang runs fc only when the spec hidden is not hidden_size wide
            chunks = [seen[k] for k in sorted(k for k in seen if k.startswith("fc_norm."))]
            if chunks:
                s["fc_in_norm"] = torch.cat(chunks, dim=-1)
            elif "input_norm" in seen:
                s["fc_in_norm"] = seen["input_norm"]
            s["fc_out"] = seen["fc"]
        s["input_ids"] = input_ids.clone()
        s["embeds"] = seen["embed_tokens"]
        for i in range(len(self.model.model.layers)):
            p = f"layers.{i}."
            if i == 0:
                s[p + "embeds_norm"] = seen["0.input_layernorm"]
                s[p + "hidden_norm"] = seen["0.hidden_norm"]
                s[p + "residual"] = seen["0.hidden_norm_in"]       # raw hidden: what attention is added to
            else:
                s[p + "hidden_norm"], s[p + "residual"] = seen[f"{i}.hidden_norm"]  # fused (normed, sum)
            s[p + "attn_in"] = seen[f"{i}.qkv_in"]
            q, k, v = seen[f"{i}.qkv"][0].split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            s[p + "q"], s[p + "k"], s[p + "v"] = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
            q_rot, k_rot = seen[f"{i}.rotary"]
            s[p + "q_rot"], s[p + "k_rot"] = q_rot.reshape(T, nh, hd), k_rot.reshape(T, nkv, hd)
            s[p + "attn_core"] = seen[f"{i}.attn"].reshape(T, nh * hd)
            s[p + "attn_out"] = seen[f"{i}.o_proj"][0]
            s[p + "post_attn_norm"], s[p + "post_attn"] = seen[f"{i}.post_attention_layernorm"]
            s[p + "mlp_out"] = seen[f"{i}.mlp"]
            # SGLang carries (mlp_out, residual) unsummed into the next norm; their sum is the layer output.
            s[p + "layer_out"] = s[p + "mlp_out"] + s[p + "post_attn"]
        s["final_norm"] = seen["norm"][0]
        s["recurrent_hidden"] = out.hidden_states.clone()
        s["logits"] = out.next_token_logits.clone()
        return s

    def _target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # SGLang maps draft-vocab ids through hot_token_id (d2t + arange), as the EAGLE worker does.
        return draft_ids if self.hot_token_id is None else self.hot_token_id[draft_ids]

    # ------------------------------------------------------------ the draft

    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """`record=False`: the stage hooks are detached (a benchmark's set-up); the trace then holds
        only what the passes return (recurrent_hidden, logits, draft_ids, target_ids)."""
        if record:
            return self._run(batch, steps)
        with self.hooks_detached():
            return self._run(batch, steps)

    def _extend(self, batch: DraftBatch, backend, slots: list[torch.Tensor], lengths: list[int]):
        """Step 0: SGLang's draft EXTEND; returns (its stages on packed rows, whether fc ran, the cached prefix)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
        from sglang.srt.speculative.spec_utils import renorm_draft_probs
        from sglang.srt.utils.common import fast_topk

        B, T = len(lengths), sum(lengths)
        last = torch.tensor(lengths).cumsum(0) - 1
        req_pool_indices = torch.arange(1, B + 1, dtype=torch.int64)
        # Each sequence is one request. With `cached_prefix`, the
        # leading tokens of each request are extended first and the rest extends over that cached
        # prefix (chunked prefill), as a server does with long prompts.
        # Copies: SGLang's forward must never write into the caller's batch.
        aux = batch.aux.to(self.dtype, copy=True)
        input_ids = batch.input_ids.long().clone()
        starts = last + 1 - torch.tensor(lengths)
        prefix = list(batch.cached_prefix) if batch.cached_prefix else [0] * B
        if not all(0 <= p < n for p, n in zip(prefix, lengths)):
            raise ValueError(f"cached_prefix {prefix} must leave at least one token of each sequence {lengths}")
        chunks = [[(0, p) for p in prefix], [(p, n) for p, n in zip(prefix, lengths)]] if any(prefix) else \
            [[(0, n) for n in lengths]]
        st, fc_ran = {}, False
        for chunk in chunks:
            rows = torch.cat([torch.arange(a, b) + s0 for (a, b), s0 in zip(chunk, starts.tolist())])
            chunk_lens = [b - a for a, b in chunk]
            seq_lens = torch.tensor([b for _, b in chunk], dtype=torch.int64)
            fb = ForwardBatch(
                forward_mode=ForwardMode.EXTEND, batch_size=B, input_ids=input_ids[rows],
                req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
                out_cache_loc=torch.cat([sl[a:b] for sl, (a, b) in zip(slots, chunk)]),
                seq_lens_sum=int(seq_lens.sum()), positions=batch.positions[rows].long().clone(),
                extend_num_tokens=len(rows),
                extend_seq_lens=torch.tensor(chunk_lens, dtype=torch.int32),
                extend_prefix_lens=torch.tensor([a for a, _ in chunk], dtype=torch.int32),
                extend_start_loc=(torch.tensor(chunk_lens).cumsum(0) - torch.tensor(chunk_lens)).to(torch.int32),
                extend_seq_lens_cpu=chunk_lens, extend_prefix_lens_cpu=[a for a, _ in chunk],
                capture_hidden_mode=CaptureHiddenMode.FULL,
                spec_info=EagleDraftExtendInput(hidden_states=aux[rows], num_tokens_per_req=1,
                                                num_tokens_for_logprob_per_req=1),
            )
            out, seen = self._forward(backend, fb)
            fc_ran = "fc" in seen
            part = self._stages(seen, aux[rows], input_ids[rows], out, aux_in=True)
            logits = part.pop("logits")
            for name, value in part.items():   # back to packed rows
                st.setdefault(name, value.new_empty((T, *value.shape[1:])))[rows] = value
        st["logits"] = logits   # the last chunk's: one row per request, its last token
        # As the worker after a draft extend: top-1 of the softmax of the last tokens' logits.
        _, draft_ids = fast_topk(renorm_draft_probs(out.next_token_logits, None, False), 1, dim=-1)
        st["draft_ids"] = draft_ids.flatten().clone()
        st["target_ids"] = self._target_ids(st["draft_ids"])
        return st, fc_ran, prefix

    def _run(self, batch: DraftBatch, steps: int) -> Trace:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        lengths = _sequence_lengths(batch)
        B = len(lengths)
        last = torch.tensor(lengths).cumsum(0) - 1                            # packed row of each last token
        backend, slots = self._pools(lengths, steps)
        self.passes = []
        req_pool_indices = torch.arange(1, B + 1, dtype=torch.int64)
        st, fc_ran, prefix = self._extend(batch, backend, slots, lengths)
        trace_steps = [st]
        trace_rows = [{"logits": last, "draft_ids": last, "target_ids": last}]

        # Steps >= 1: SGLang's draft DECODE, one query per request (its last token).
        hidden = st["recurrent_hidden"][last]
        prev_target = st["target_ids"]
        last_pos = batch.positions[last].long()
        for k in range(1, steps):
            ids = batch.next_ids[last, k - 1].long() if batch.next_ids is not None else prev_target
            seq_lens = torch.tensor(lengths, dtype=torch.int64) + k
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=ids,
                req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
                out_cache_loc=torch.stack([sl[n + k - 1] for sl, n in zip(slots, lengths)]),
                seq_lens_sum=int(seq_lens.sum()), positions=last_pos + k,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                spec_info=EagleDraftInput(hidden_states=hidden, num_tokens_per_req=1,
                                          num_tokens_for_logprob_per_req=1),
            )
            out, seen = self._forward(backend, fb)
            st = self._stages(seen, hidden, ids, out, aux_in=False)
            # The worker's topk == 1 draft step on a CPU host: argmax of the logits.
            st["draft_ids"] = torch.argmax(out.next_token_logits, dim=-1).clone()
            st["target_ids"] = self._target_ids(st["draft_ids"])
            trace_steps.append(st)
            trace_rows.append({name: last for name in st})
            hidden, prev_target = out.hidden_states, st["target_ids"]

        notes = [
            f"attention backend {self.attention_backend}",
            f"fc ran at step 0: {'yes' if fc_ran else 'no (aux width equals hidden_size)'}",
            "runtime adjustments: " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in self.runtime["adjustments"].items()),
            f"step 0: EXTEND of {B} requests" + (f" in two chunks (cached prefix {prefix})" if any(prefix) else "")
            + "; steps >= 1: DECODE on each request's last token",
            "config via sglang get_config; weights via LlamaForCausalLMEagle3.load_weights",
        ]
        return Trace(impl="sglang", dtype=self.dtype, steps=trace_steps, rows=trace_rows, notes=notes)

    # ------------------------------------------------------------ tree drafting (topk > 1)

    def run_tree(self, batch: DraftBatch, steps: int, topk: int, num_draft_tokens: int) -> Trace:
        """SGLang's EAGLE tree draft (EagleWorkerV2.draft_forward, eagle_worker_v2.py:742-923) over its
        own helpers. Step 0 is the draft EXTEND; step k >= 1 is draft-decode pass k - 1, one query per
        tree row b*topk + r. Each step also holds the candidates its rows propose (`candidate_ids`,
        `candidate_scores` as log of SGLang's probability products, `selected` within the candidates);
        the last step holds organize_draft_results' tree (`tree_tokens`, `tree_index`, `tree_parents`).
        See conformance/draft/test_tree.py for the semantics and the KV layout."""
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.eagle_utils import organize_draft_results, per_step_draft_out_cache_loc
        from sglang.srt.speculative.spec_utils import renorm_draft_probs, select_top_k_tokens
        from sglang.srt.utils.common import fast_topk

        if self.attention_backend != ATTENTION_BACKEND:
            raise NotImplementedError(f"tree drafting is driven through {ATTENTION_BACKEND} only")
        if not 2 <= num_draft_tokens <= topk + (steps - 1) * topk * topk + 1:
            raise ValueError(f"num_draft_tokens {num_draft_tokens} does not fit a tree of topk {topk}, {steps} steps")
        lengths = _sequence_lengths(batch)
        B, N = len(lengths), len(lengths) * topk
        last = torch.tensor(lengths).cumsum(0) - 1
        backend, slots = self._pools(lengths, topk * steps + 1)       # prefix + topk*steps draft slots each
        self.passes = []
        st, fc_ran, _ = self._extend(batch, backend, slots, lengths)
        trace_steps, trace_rows = [st], [{"logits": last, "draft_ids": last, "target_ids": last}]

        out_cache_loc, branch_rows = draft_kv_layout(slots, lengths, topk, steps)
        write_locs = per_step_draft_out_cache_loc(out_cache_loc, B, topk, steps)     # [steps, N]: SGLang's slicing
        # torch_native reads a row's keys through req_to_token: one request row per tree row.
        rows_pool = ReqToTokenPool(size=N, max_context_len=max(lengths) + steps, device=self.device,
                                   enable_memory_saver=False)
        for j, row in enumerate(branch_rows):
            rows_pool.req_to_token[1 + j, :row.numel()] = row.to(torch.int32)
        tree_backend = ATTENTION_BACKENDS[ATTENTION_BACKEND](SimpleNamespace(
            device=self.device, req_to_token_pool=rows_pool, token_to_kv_pool=backend.token_to_kv_pool))

        # As the worker after a draft extend (eagle_worker_v2.py:1071-1085), then draft_forward's entry
        # mapping to target ids (eagle_worker_v2.py:757-758).
        topk_p, topk_index = fast_topk(renorm_draft_probs(st["logits"], None, False), topk, dim=-1)
        topk_index = self._target_ids(topk_index)
        hidden = st["recurrent_hidden"][last]
        positions = (batch.positions[last].long() + 1).repeat_interleave(topk)   # seq_lens.repeat_interleave(topk)
        scores, score_list, token_list, parents_list = None, [], [], []
        for i in range(steps):
            with eager_tree_helpers():
                input_ids, hidden, scores, (cand_scores, cand_ids, parents) = select_top_k_tokens(
                    i, topk_p, topk_index, hidden, scores, topk)
            score_list.append(cand_scores)
            token_list.append(cand_ids)
            parents_list.append(parents)
            # Layout -> canonical: parents are ids in the flat candidate list (-1 the root).
            offset = 0 if i == 0 else topk * topk * (i - 1) + topk
            trace_steps[i].update({"candidate_ids": cand_ids.clone(),
                                   "candidate_scores": cand_scores.flatten(1).log(),
                                   "selected": (parents[:, 1:] if i == 0 else parents) - offset})
            if i == steps - 1:
                break
            seq_lens = torch.tensor(lengths, dtype=torch.int64).repeat_interleave(topk) + i + 1
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=N, input_ids=input_ids,
                req_pool_indices=torch.arange(1, N + 1, dtype=torch.int64), seq_lens=seq_lens,
                seq_lens_cpu=seq_lens.clone(), out_cache_loc=write_locs[i], seq_lens_sum=int(seq_lens.sum()),
                positions=positions + i, capture_hidden_mode=CaptureHiddenMode.LAST,
                spec_info=EagleDraftInput(hidden_states=hidden, num_tokens_per_req=1,
                                          num_tokens_for_logprob_per_req=1),
            )
            out, seen = self._forward(tree_backend, fb)
            trace_steps.append(self._stages(seen, hidden, input_ids, out, aux_in=False))
            trace_rows.append({})
            # draft_forward's topk > 1 branch without rejection sampling (eagle_worker_v2.py:881-898).
            topk_p, topk_index = fast_topk(renorm_draft_probs(out.next_token_logits, None, False), topk, dim=-1)
            topk_index = self._target_ids(topk_index)
            hidden = out.hidden_states

        parent_list, top_scores_index, draft_tokens = organize_draft_results(
            score_list, token_list, parents_list, num_draft_tokens)
        trace_steps[-1].update({"tree_tokens": draft_tokens, "tree_index": top_scores_index,
                                "tree_parents": parent_list})
        notes = [f"attention backend {self.attention_backend}", f"fc ran at step 0: {'yes' if fc_ran else 'no'}",
                 f"tree: topk {topk}, {steps} steps, {num_draft_tokens} draft tokens; EXTEND then {steps - 1} "
                 "draft-decode passes over batch*topk rows"]
        return Trace(impl="sglang", dtype=self.dtype, steps=trace_steps, rows=trace_rows, notes=notes)
