"""vLLM 0.33.0's MLA EAGLE-3 draft (`Eagle3DeepseekV2ForCausalLM`, vllm/model_executor/models/deepseek_eagle3.py:274),
read and loaded by vLLM's own code in its worker (worker_mla.py) and set against the reference's reading of the same
file: its config resolution and what the built modules state (`reading`, `differences`), and its `load_weights`
accounted for tensor by tensor (`account`, as the Llama draft's: weights.py). Its forward is not run (FORWARD_NOT_RUN).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from conformance.adapters.vllm.process import DTYPE_NAMES, Worker
from conformance.checkpoints import WEIGHTS_FILE
from conformance.loading import accounting
from conformance.loading.accounting import Accounting, load_and_count
from reference.eagle3 import Eagle3Config

# Why the MLA draft's forward does not run in this lane (the support matrix's vLLM cell, every skipped comparison).
# That kernel is also built for a 576-wide latent cache only (kv_lora_rank 512 + rope 64, cpu_mla.py:61-64): the
# suite's tiny MLA drafts would not run on vLLM's CPU build either, the published Kimi-K2.5 draft's size would.
FORWARD_NOT_RUN = ("its MLA attention on CPU is CPU_MLA, whose decode calls torch.ops._C.mla_decode_kvcache "
                   "(vllm/v1/attention/backends/mla/cpu_mla.py:180), a compiled op of vLLM's CPU build absent from "
                   "this lane's CUDA wheel; FLEX_ATTENTION is not an MLA backend")
CHECKED = "config + weights checked; forward not run"


def reading(ckpt_dir: Path, positions: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """What vLLM resolved from the draft's config and what its built modules state (worker_mla.reading); with
    `positions`, also its rope table there ("cos", "sin": [len(positions), qk_rope_head_dim / 2], one angle per
    rope pair)."""
    worker = Worker.get()
    work = worker.scratch()
    wanted = [0] if positions is None else positions.tolist()
    seen = worker.ask("mla_reading", ckpt=str(Path(ckpt_dir).resolve()), dtype=DTYPE_NAMES[dtype], work=str(work),
                      positions=wanted, rope=str(work / "rope.safetensors"))
    return {**seen, **(load_file(str(work / "rope.safetensors")) if positions is not None else {})}


def rope_against_reference(seen: dict, cfg: Eagle3Config, positions: torch.Tensor) -> list:
    """vLLM's rope table at `positions` (`reading`) against the reference's (reference/rope.py rope_cos_sin on the
    draft's MLAConfig: one angle per pair, the first half of its [T, rd] tables), in vLLM's table dtype, fp32, with
    the fp64 reference for the error model, under the tolerance of the stage they turn (k_rope). StageResults."""
    from conformance.core.compare import compare_tensors
    from reference.rope import rope_cos_sin

    half = cfg.qk_rope_head_dim // 2
    out = []
    for i, name in enumerate(("cos", "sin")):
        same, precise = (rope_cos_sin(cfg.mla, positions, d)[i][:, :half] for d in (torch.float32, torch.float64))
        out.append(compare_tensors(0, "layers.0.k_rope", seen[name], precise, torch.float32, precise=precise,
                                   same=same))
    return out


def config_reading(ckpt_dir: Path) -> dict:
    """vLLM's config resolution of the draft alone, nothing built (a published draft of its real size)."""
    worker = Worker.get()
    return worker.ask("mla_config", ckpt=str(Path(ckpt_dir).resolve()), dtype="bfloat16", work=str(worker.scratch()))


def reference_values(cfg: Eagle3Config) -> dict[str, object]:
    """What the reference reads from the same file, under the names `observed` gives vLLM's."""
    from reference.rope import rope_inv_freq

    mla, scaling = cfg.mla, dict(cfg.rope_scaling or {})
    yarn = scaling.get("rope_type", "default") != "default"
    return {
        "draft_arch": cfg.draft_arch, "num_attention_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.rope_interleave, "rope_theta": float(cfg.rope_theta),
        "rope_scaling.factor": float(scaling["factor"]) if yarn else 1.0,
        "rope_scaling.original_max_position_embeddings":
            scaling.get("original_max_position_embeddings", cfg.max_position_embeddings) if yarn else None,
        "rope_scaling.beta": [float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)]
                             if yarn else None,
        "rope cos/sin scale": float(rope_inv_freq(mla)[1]), "softmax scale": float(mla.softmax_scale),
        "rms_norm_eps": float(cfg.rms_norm_eps), "num_hidden_layers": cfg.num_hidden_layers,
        "num_aux_hidden_states": cfg.num_aux_hidden_states,
        "fc": [cfg.num_aux_hidden_states * cfg.target_hidden_size, cfg.hidden_size],
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "hidden_act": cfg.hidden_act,
    }


def observed(seen: dict) -> dict[str, object]:
    """vLLM's reading (worker_mla.reading) under the reference's names: each value read off its built modules."""
    yarn = seen["rope_class"] != "RotaryEmbedding"
    return {
        # the layer's attention class is what makes it an MLA draft (the draft ModelConfig's own use_mla reads the
        # EAGLEConfig wrapper's model_type, `eagle`: vllm/transformers_utils/configs/eagle.py:11-12)
        "draft_arch": "mla" if seen["attention_class"] == "DeepseekV2MLAAttention" else seen["attention_class"],
        "num_attention_heads": seen["num_heads"], "q_lora_rank": seen["q_lora_rank"],
        "kv_lora_rank": seen["kv_lora_rank"], "qk_nope_head_dim": seen["qk_nope_head_dim"],
        "qk_rope_head_dim": seen["rotary_dim"], "v_head_dim": seen["v_head_dim"],
        "rope_interleave": seen["rope_interleaved"], "rope_theta": seen["rope_base"],
        "rope_scaling.factor": seen["rope_factor"],
        "rope_scaling.original_max_position_embeddings": seen["rope_context"] if yarn else None,
        "rope_scaling.beta": [float(b) for b in seen["rope_beta"]] if yarn else None,
        "rope cos/sin scale": seen["rope_mscale"], "softmax scale": seen["softmax_scale"],
        "rms_norm_eps": seen["rms_norm_eps"], "num_hidden_layers": seen["layers"],
        "num_aux_hidden_states": seen["num_aux_hidden_states"], "fc": seen["fc"],
        "fc_norm": seen["fc_norm"], "norm_output": seen["norm_output"],
        "norm_before_residual": seen["norm_before_residual"], "norm_before_fc": seen["input_norm"],
        "vocab_size": seen["vocab"], "draft_vocab_size": seen["draft_vocab"],
        "hidden_act": "silu" if seen["hidden_act"] == "SiluAndMul" else seen["hidden_act"],
    }


def differences(seen: dict, cfg: Eagle3Config) -> list[tuple[str, object, object]]:
    """(key, vLLM's value, the reference's) wherever vLLM reads the file otherwise than the reference."""
    ours, theirs = reference_values(cfg), observed(seen)
    return [(key, theirs[key], ours[key]) for key in ours if theirs[key] != ours[key]]


def account(ckpt_dir: Path, dtype: torch.dtype) -> Accounting:
    """vLLM's load observed in the worker (worker_mla.mla_account), accounted for here as the Llama draft's
    (weights.py): every landing bit for bit, q_a_proj / kv_a_proj_with_mqa in their rows of fused_qkv_a_proj (its
    `output_sizes`), d2t on draft_id_to_target_id, t2d skipped by its own code (deepseek_eagle3.py:376-377). With no
    forward run, every parameter no tensor filled is never loaded."""
    from conformance.adapters.vllm.weights import land_calls, uses

    def observed_load():
        worker = Worker.get()
        work = worker.scratch()
        answer = worker.ask("mla_account", ckpt=str(ckpt_dir.resolve()), weights=str(ckpt_dir.resolve() / WEIGHTS_FILE),
                            dtype=DTYPE_NAMES[dtype], work=str(work), params=str(work / "params.safetensors"))
        return answer, load_file(str(work / "params.safetensors"))

    acct, ckpt, got = load_and_count("vllm", ckpt_dir, observed_load)
    if got is None:
        return acct
    answer, params = got
    unfilled = land_calls(acct, ckpt, params, answer)
    acct.never_loaded = sorted(unfilled - absorbed(acct, ckpt, params, answer["calls"]))
    acct.uses = uses(answer, None)
    acct.knobs = {"class": answer["class"], "forward": f"not run: {FORWARD_NOT_RUN}"}
    return acct


def absorbed(acct: Accounting, ckpt: dict, params: dict, calls: list) -> set[str]:
    """The parameters vLLM's MLA layer derives from kv_b_proj after loading, never from a checkpoint tensor: W_UK_T
    and W_UV, its per-head k and v halves laid out for the absorbed attention (split_kv_b_proj and
    process_weights_after_loading, vllm/model_executor/layers/attention/mla_attention.py:416-423, 1270-1349). Each is
    verified bit for bit against the stored kv_b_proj ([N*(P+V), L]: per head, P rows of k then V of v) and listed as
    derived; one that differs is named. Returns their names."""
    stored = {pname: name for name, pname, _ in calls}
    out = set()
    for pname in sorted(params):
        if not pname.endswith(".W_UK_T"):
            continue
        layer = pname.split(".self_attn.")[0]
        kv_b = ckpt.get(stored.get(f"{layer}.self_attn.kv_b_proj.weight", ""))
        uk_t, uv = pname, pname[:-len("W_UK_T")] + "W_UV"
        N, P, L = params[uk_t].shape
        for name in (uk_t, uv):
            out.add(name)
            if kv_b is None:
                acct.differs.append(f"{name} (no kv_b_proj stored to derive it from)")
                continue
            per_head = kv_b.T.reshape(L, N, -1)   # [L, N, P + V]
            expected = per_head[..., :P].permute(1, 2, 0) if name == uk_t else per_head[..., P:].transpose(0, 1)
            if accounting._equal(params[name], expected):   # the accounting's one bit-equality
                acct.ignored.append(f"{name} (derived from kv_b_proj after loading, equal)")
            else:
                acct.differs.append(f"{name} (derived from kv_b_proj after loading)")
    return out
