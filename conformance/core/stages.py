"""The canonical stage names of a draft step, defined once, in forward order.

Every adapter maps its implementation onto these names (fused layouts split back, fused residual
pairs summed); a stage an implementation does not expose is absent from its trace, never faked.
Per-layer stages are prefixed `layers.{i}.`. An MLA draft layer (DeepSeek's latent attention,
reference/eagle3.py mla_attention) has q_latent, kv_latent and k_rope, the pieces an MLA KV pool and
its q LoRA hold, and no k; kv_latent and k_rope are what an MLA pool caches per token.
"""
from __future__ import annotations

PRE = (
    "aux_in",           # step 0: the target's aux hidden states, [T, A*Ht]
    "fc_in_norm",       # step 0: input_norm / fc_norm output, when the draft has one
    "fc_out",           # step 0: fc output, [T, H]
    "hidden_in",        # steps >= 1: the recurrent hidden this step was fed (the previous step's output)
    "input_ids",        # the token ids embedded at this step
    "embeds",
)
LAYER = (
    "embeds_norm",      # layer 0 only: input_layernorm(embeds)
    "hidden_norm",      # the normed hidden entering attention (hidden_norm on layer 0, input_layernorm after)
    "residual",         # what the attention output is added to
    "attn_in",          # q/k/v projection input: [embeds_norm, hidden_norm] on layer 0
    "q_latent",         # MLA with q_lora_rank only: q_a_layernorm(q_a_proj(attn_in)), [T, q_lora_rank]
    "q", "k", "v",      # [T, heads, head_dim], before RoPE (MLA: q [T, nh, nope+rope], no k, v [T, nh, v_head_dim])
    "kv_latent",        # MLA only: kv_a_layernorm of the latent slice of kv_a_proj_with_mqa, [T, kv_lora_rank]
    "q_norm", "k_norm", # qwen3 draft layers only: per-head RMSNorm of q and k, before RoPE
    "k_rope",           # MLA only: the rope key shared by all heads, after RoPE, [T, qk_rope_head_dim]
    "q_rot", "k_rot",   # after RoPE (MLA: each head [nope | rope], the rope slice in DeepSeek's interleaved order)
    "attn_core",        # attention output before o_proj, [T, nh*hd] (MLA: [T, nh*v_head_dim])
    "attn_out",         # after o_proj
    "post_attn",        # residual + attn_out
    "post_attn_norm",   # post_attention_layernorm(post_attn)
    "mlp_out",
    "layer_out",        # post_attn + mlp_out
)
POST = ("final_norm", "recurrent_hidden", "logits", "draft_ids", "target_ids")

# Tree drafting (topk > 1; conformance/draft/test_tree.py): per step, the children its rows propose and
# which of them are expanded; after the last step, the tree handed to verification.
TREE = ("candidate_ids", "candidate_scores", "selected")
TREE_FINAL = ("tree_tokens", "tree_index", "tree_parents")

ID_STAGES = frozenset({"input_ids", "draft_ids", "target_ids", "candidate_ids", "selected", *TREE_FINAL})


def stage_names(num_layers: int) -> tuple[str, ...]:
    """All canonical stage names of one draft step, in forward order."""
    per_layer = tuple(f"layers.{i}.{s}" for i in range(num_layers) for s in LAYER if i == 0 or s != "embeds_norm")
    return PRE + per_layer + POST


def stage_kind(stage: str) -> str:
    """The tolerance-table key of a stage: 'ids', 'logits' or 'hidden'."""
    base = stage.rsplit(".", 1)[-1]
    if base in ID_STAGES:
        return "ids"
    return "logits" if base == "logits" else "hidden"
