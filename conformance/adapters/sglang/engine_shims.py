"""What runs inside SGLang's spawned scheduler process: the CPU shims, planted faults, and the capture.

`sglang.Engine` starts its scheduler with the spawn start method, so nothing patched in the test
process reaches it. `ShimmedEngine` (engine.py) points SGLang's extension point
`Engine.run_scheduler_process_func` at `run_scheduler_process` below, which sets the shims up in the
scheduler process and then calls SGLang's own `run_scheduler_process`. Only the tree-build and
greedy-verify kernels differ from what a CUDA server runs (shim `spec_tree._is_xpu`); every other
shim selects the same code, run eagerly or by Triton's interpreter.

The capture observes, never changes: stage hooks on the draft model (the model-level adapter's
recorder, recorder.py), the worker's batch (request ids) and round results,
each written as one safetensors file per event so that the test process can read them back.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from conformance.adapters.sglang.recorder import Recorder, canonical_stages

# name -> what it changes; reported with each engine (conformance/engine/reporting.py). apply_shims
# reports what it did under the same names.
SHIMS = {
    "TRITON_INTERPRET=1": "environment, set before the scheduler imports triton: every @triton.jit kernel of SGLang "
                          "(Triton attention backend, KV copy/warmup, draft cache-location assignment, tree build "
                          "and verify) runs in Triton's interpreter on CPU tensors; same kernel source, fp32 numpy",
    "attention_backend=triton": "server argument: SGLang's Triton attention backend (torch_native has no EAGLE "
                                "multi-step draft backend, speculative/draft_utils.py:64, and cannot serve a "
                                "TARGET_VERIFY batch, torch_native_backend.py:101)",
    "sglang.kernels.ops.speculative.spec_tree._is_xpu": (
        "module flag of the module that dispatches the tree kernels (spec_tree; sglang.srt.speculative.eagle_utils "
        "before 0.5.23, compat.tree_dispatch_module) only: tree build (sgl_build_tree_kernel_triton) and greedy "
        "verify (verify_tree_greedy_triton) run SGLang's Triton port shipped for Intel XPU instead of the CUDA-JIT "
        "kernels, which are absent here: same operation and arguments, a different kernel"),
    "sglang.kernels.ops.speculative.cache_locs._is_xpu": (
        "module flag of that module only: verify's cache-location assignment (assign_extend_cache_locs[_uniform]) "
        "takes the Triton branch that CUDA, HIP, MUSA and XPU share, the kernel a CUDA server runs; on an unknown "
        "platform it falls through and returns None (reached by topk > 1 trees: a chain plans its verify window "
        "while drafting)"),
    "sglang.srt.layers.rotary_embedding.base._is_cpu": (
        "module flag: RoPE dispatches to SGLang's forward_native (no vllm fallback import), as the model-level "
        "adapter (runtime.py cpu_runtime_adjustments)"),
    "triton.runtime.interpreter.InterpreterBuilder.create_dot": (
        "Triton's interpreter holds a bfloat16 tensor as its raw uint16 bits (triton 3.8.0 runtime/interpreter.py:"
        "161-162) and its tl.dot multiplies those bits as integers (create_dot, :705-712: only 8-bit floats are "
        "converted first), so every bf16 attention kernel returns garbage (max error ~2e10 on a 16x16 product; "
        "an fp32 engine is unaffected). The operands are widened to the fp32 values they hold first: a bf16 "
        "product accumulated in the accumulator's fp32, what a GPU's bf16 dot computes"),
    "sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM.set_embed": (
        "the MLA draft's set_embed and set_embed_and_head (kimi_k25_eagle3.py:404-423, called when the worker shares "
        "the target's embedding, eagle_worker_v2.py:363) end in torch.cuda.empty_cache() and torch.cuda.synchronize(), "
        "which fail on a host without a CUDA driver; the Llama draft's (llama.py:895-925) call SGLang's "
        "current_platform's instead, and so do these while the shim runs: the same weights shared, no CUDA call"),
    "torch.compiler.set_stance": (
        "process-wide force_eager: SGLang's torch.compile'd helpers (spec_utils.py:437, layers/sampler.py:933) run "
        "their Python bodies eagerly instead of an inductor C++ build"),
}


def apply_shims() -> dict[str, str]:
    """The in-process shims; returns {shim: before -> after} for the report. Raises when Triton's
    interpreter is off: the kernels were then decorated for a GPU driver that does not exist."""
    import triton

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET=1 must be in the scheduler's environment before triton is imported")
    from sglang.kernels.ops.speculative import cache_locs, spec_tree

    from conformance.adapters.sglang import compat
    from conformance.adapters.sglang.runtime import cpu_runtime_adjustments

    done = {"TRITON_INTERPRET=1": "interpreter on"}
    done.update({k: f"{a} -> {b}" for k, (a, b) in cpu_runtime_adjustments().items()})
    for name, module in ((f"{spec_tree.__name__}._is_xpu", compat.tree_dispatch_module()),
                         (f"{cache_locs.__name__}._is_xpu", cache_locs)):
        before, module._is_xpu = module._is_xpu, True
        done[name] = f"{before} -> True" + ("" if module.__name__ in name else f" (in {module.__name__})")
    done["triton.runtime.interpreter.InterpreterBuilder.create_dot"] = widen_bf16_dot_operands()
    done["sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM.set_embed"] = platform_calls_in_mla_set_embed()
    torch.compiler.set_stance("force_eager")
    done["torch.compiler.set_stance"] = "default -> force_eager"
    return done


def widen_bf16_dot_operands() -> str:
    """Triton's interpreter's tl.dot on bfloat16 operands computes with their fp32 values (SHIMS says why)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return "bf16 operands widened (already)"
    original = builder.create_dot

    def widened(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        values = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True
    builder.create_dot = create_dot
    return "raw bf16 bits multiplied -> bf16 operands widened to their fp32 values"


def platform_calls_in_mla_set_embed() -> str:
    """The MLA draft's embedding hand-over calls SGLang's current_platform where it calls torch.cuda (SHIMS says
    why); nothing changes on a host with CUDA."""
    import unittest.mock

    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
    from sglang.srt.platforms import current_platform

    if torch.cuda.is_available():
        return "CUDA present: unchanged"
    for name in ("set_embed", "set_embed_and_head"):
        original = getattr(Eagle3DeepseekV2ForCausalLM, name)
        if getattr(original, "platform_calls", False):
            return "torch.cuda calls -> current_platform's (already)"

        @functools.wraps(original)
        def on_platform(self, *args, _original=original, **kwargs):
            with unittest.mock.patch.object(torch.cuda, "synchronize", current_platform.synchronize), \
                    unittest.mock.patch.object(torch.cuda, "empty_cache", current_platform.empty_cache):
                return _original(self, *args, **kwargs)

        on_platform.platform_calls = True
        setattr(Eagle3DeepseekV2ForCausalLM, name, on_platform)
    return "torch.cuda.empty_cache/synchronize -> current_platform's"


def run_scheduler_process(*args, capture_dir: str | None = None, fault_yaml: str | None = None, **kwargs):
    """SGLang's run_scheduler_process, after the shims, a planted fault (a source_patcher YAML, SGLang's
    own mechanism) and the capture. Picklable with functools.partial: it is the spawned process's target."""
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    done = apply_shims()
    if fault_yaml:
        from sglang.srt.debug_utils.source_patcher import apply_patches_from_config

        apply_patches_from_config(fault_yaml)
    if capture_dir:
        # Under tensor parallelism every rank is a scheduler process of its own: each captures into its own
        # folder (rank 0's is the capture folder itself, what a TP 1 engine writes).
        tp_rank = kwargs["tp_rank"] if "tp_rank" in kwargs else args[3]   # run_scheduler_process's 4th argument
        directory = rank_dir(Path(capture_dir), tp_rank)
        Capture(directory).install()
        (directory / "shims.json").write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
    return sglang_run(*args, **kwargs)


def rank_dir(capture_dir: Path, tp_rank: int) -> Path:
    return capture_dir if tp_rank == 0 else capture_dir / f"rank{tp_rank}"


class Capture:
    """Writes one file per event: `draft pass` (a forward of the draft model: its batch layout and
    canonical stages), `tree` (draft_forward's result: the drafted tokens of a round), `round` (a
    worker call: its requests and what verify accepted)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seq = 0
        self.call = -1
        self.rids: list[str] = []
        self.drafts: dict[int, ServedDraft] = {}

    def write(self, kind: str, tensors: dict[str, torch.Tensor], **meta) -> None:
        from safetensors.torch import save_file

        meta.update(kind=kind, call=self.call, rids=self.rids)
        flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items() if v is not None}
        name = self.dir / f"event_{self.seq:06d}.safetensors"
        tmp = name.with_suffix(".tmp")
        save_file(flat, str(tmp), metadata={"meta": json.dumps(meta)})
        os.replace(tmp, name)   # a reader never sees half a file
        self.seq += 1

    def install(self, passes: bool = True) -> None:
        """passes=False: the rounds only (drafted tokens, what verify accepted), not the draft model's passes. On a
        CUDA runner the draft's decode passes replay a CUDA graph, which runs no Python of the model, and a
        device-to-host copy inside a graph being captured is an error; the tokens are read outside any graph
        (eagle_worker_v2.py:693-729: draft() calls build_eagle_verify_input after the graph's replay)."""
        from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
        from sglang.srt.speculative import eagle_worker_v2
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        capture = self
        generation = EAGLEWorkerV2.forward_batch_generation
        # The draft's result of a round, as draft() hands it to verification: the module-level name
        # draft() calls. (Not draft_forward itself: SGLang's own fault switches rewrite its source.)
        build_verify_input = eagle_worker_v2.build_eagle_verify_input

        @functools.wraps(generation)
        def forward_batch_generation(worker, batch, *args, **kwargs):
            capture.call += 1
            capture.rids = [req.rid for req in batch.reqs]
            mode = batch.forward_mode.name
            out = generation(worker, batch, *args, **kwargs)
            capture.write("round", {"accept_lens": out.accept_lens, "next_token_ids": out.next_token_ids},
                          mode=mode)
            return out

        def build_verify_input_recorded(batch, draft_input, parent_list, top_scores_index, draft_tokens,
                                        *args, **kwargs):
            if draft_tokens is not None:   # None: an idle batch
                capture.write("tree", {"parent_list": parent_list, "top_scores_index": top_scores_index,
                                       "draft_tokens": draft_tokens}, topk=kwargs.get("topk"))
            return build_verify_input(batch, draft_input, parent_list, top_scores_index, draft_tokens,
                                      *args, **kwargs)

        def recorded(model_forward):
            @functools.wraps(model_forward)
            def model_forward_recorded(model, input_ids, positions, forward_batch, *args, **kwargs):
                served = capture.served(model)
                served.begin()
                spec_hidden = forward_batch.spec_info.hidden_states.clone()
                ids, pos = input_ids.clone(), positions.clone()
                out = model_forward(model, input_ids, positions, forward_batch, *args, **kwargs)
                mode = forward_batch.forward_mode
                # Extend passes (prefill chunks, and the draft extend after verify) are fed the target's aux states.
                aux_in = mode.is_extend(include_draft_extend_v2=True)
                stages = served.stages(spec_hidden, ids, out, aux_in, forward_batch)
                layout = {"positions": pos, "seq_lens": forward_batch.seq_lens,
                          "extend_seq_lens": forward_batch.extend_seq_lens,
                          "extend_prefix_lens": forward_batch.extend_prefix_lens,
                          "req_pool_indices": forward_batch.req_pool_indices}
                capture.write("draft pass", {**{f"stage:{k}": v for k, v in stages.items()}, **layout},
                              mode=mode.name, batch_size=forward_batch.batch_size)
                return out
            return model_forward_recorded

        # Which speculative worker class the scheduler builds (scheduler.py:1063 -> spec_info.py create_worker:
        # EAGLEWorkerV2, MultiLayerEagleWorkerV2, ...), for the report; the class is returned as it is.
        create_worker = SpeculativeAlgorithm.create_worker

        @functools.wraps(create_worker)
        def create_worker_observed(algorithm, server_args):
            worker_class = create_worker(algorithm, server_args)
            name = "" if worker_class is None else f"{worker_class.__module__}.{worker_class.__name__}"
            (capture.dir / "drafter.txt").write_text(name + "\n")
            return worker_class

        SpeculativeAlgorithm.create_worker = create_worker_observed
        EAGLEWorkerV2.forward_batch_generation = forward_batch_generation
        eagle_worker_v2.build_eagle_verify_input = build_verify_input_recorded
        if passes:   # the Llama draft and the MLA draft (engine_mla.py)
            for draft_class in (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM):
                draft_class.forward = recorded(draft_class.forward)

    def served(self, model):
        """The served draft's recorder: ServedDraft (Llama layers), engine_mla.ServedMLADraft (MLA)."""
        from conformance.adapters.sglang.engine_mla import ServedMLADraft

        if id(model) not in self.drafts:
            mla = hasattr(model.model, "midlayer") and hasattr(model.model.midlayer.self_attn, "kv_lora_rank")
            self.drafts[id(model)] = (ServedMLADraft if mla else ServedDraft)(model)
        return self.drafts[id(model)]


class ServedDraft:
    """The served draft model with the model-level adapter's stage hooks (recorder.Recorder): what
    recorder.canonical_stages reads to map one pass onto the canonical stages."""

    def __init__(self, model):
        self.model = model
        self.recorder = Recorder(model)
        attn0 = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim

    def begin(self) -> None:
        self.recorder.take()

    def stages(self, spec_hidden: torch.Tensor, input_ids: torch.Tensor, out, aux_in: bool, forward_batch) -> dict:
        return canonical_stages(self, self.recorder.take(), spec_hidden, input_ids, out, aux_in=aux_in)
