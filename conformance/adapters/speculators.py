"""speculators 0.9.0's EAGLE-3 training model (`Eagle3DraftModel`), loaded and run in-process.

The checkpoint goes through speculators' own config class and its transformers loading path, the
TTT forward is speculators' own, and every stage is read by forward hooks (observation only) on its
modules, mapped to the canonical names of conformance/core/stages.py (`eagle3-semantics.md` §1.1).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open

from conformance.core import stages
from conformance.adapters.base import Trace, batch_on
from fixtures.checkpoint import WEIGHTS_FILE
from reference.eagle3 import DraftBatch, Eagle3Config

# Only used by the training loss (verifier_last_hidden_states), which is never run here; they are
# filled from the verifier checkpoint, and this draft has none (verifier name_or_path is null).
VERIFIER_OWNED = ("verifier_lm_head.weight", "verifier_norm.weight")

# Local variables of speculators' code, not module inputs/outputs: the first layer's residual
# (model_definitions.py:75-81) and the post-RoPE query (LlamaAttention.forward).
NOT_OBSERVABLE = frozenset({"residual", "q_rot"})

CPU_ATTENTION = "sdpa"   # see load()


class SpeculatorsAdapter:
    name: ClassVar[str] = "speculators"
    checkpoint_format: ClassVar[str] = "speculators"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST) - NOT_OBSERVABLE

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        # target_hidden_size != hidden_size is not refused here: speculators' own loader fails on
        # it (fc is A*hidden_size -> hidden_size, core.py:76-78), and that failure is the finding.
        return None

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedSpeculators":
        # Imported here: speculators takes seconds to import and only this adapter needs it.
        from speculators.model import SpeculatorModel
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
        from speculators.models.eagle3.core import Eagle3DraftModel

        ckpt_dir = Path(ckpt_dir)
        config = Eagle3SpeculatorConfig.from_pretrained(ckpt_dir)
        # The default simple_flex_attention needs T % 128 == 0 and is slow on CPU; "sdpa" runs the
        # same TTT mask as a dense boolean mask (core.py:54-60, attention.py extend_dense_...).
        # On CUDA speculators keeps its own default, the flex attention it trains with.
        config.transformer_layer_config._attn_implementation = attention_for(device)
        # speculators' own `Eagle3DraftModel.from_pretrained` cannot load this checkpoint: after
        # loading it calls `load_verifier_weights`, whose Eagle3 override runs
        # `AutoConfig.from_pretrained(None)` when the verifier path is null (core.py:174-180) and so
        # goes to the hub; it also breaks on `output_loading_info=True` (core.py:166-167 expects a
        # model). So this is the call it makes itself (model.py:381-393): transformers'
        # from_pretrained on Eagle3DraftModel with the Eagle3SpeculatorConfig read above. The two
        # steps it skips are no-ops without a verifier: load_vocab_mappings(None, None) returns at
        # once (model.py:88-89) and the base load_verifier_weights returns at once (model.py:151-152).
        # ignore_mismatched_sizes=True only turns transformers' "see the report above" error into an
        # entry of its loading report, which _check_every_tensor_loaded raises on with the shapes
        # (e.g. fc.weight when target_hidden_size != hidden_size: fc is A*hidden_size -> hidden_size,
        # core.py:76-78).
        model, info = super(SpeculatorModel, Eagle3DraftModel).from_pretrained(
            ckpt_dir, config=config, output_loading_info=True, local_files_only=True,
            ignore_mismatched_sizes=True,
        )
        _check_every_tensor_loaded(model, ckpt_dir, info)
        model = to_compute_dtype(model.to(device), dtype).eval()
        return LoadedSpeculators(model, dtype, info, device)


def to_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Parameters in `dtype`, buffers as loaded: what speculators' training computes with.

    Training keeps the model in fp32 and casts only parameters to the compute dtype (FSDP's
    MixedPrecisionPolicy(param_dtype=...), train/distributed.py:206-209; torch.autocast without
    FSDP, train/trainer.py:539), so the rotary inverse frequencies stay fp32. `model.to(bf16)`
    would round them to bf16, which turns keys by up to a radian at position 2000.
    """
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def attention_for(device: str) -> str | None:
    """The attention speculators runs on `device`: sdpa on CPU; None = its default (flex) elsewhere."""
    return CPU_ATTENTION if torch.device(device).type == "cpu" else None


def _check_every_tensor_loaded(model: torch.nn.Module, ckpt_dir: Path, info: dict) -> None:
    """One-line errors when a checkpoint tensor was dropped or a model tensor kept its init.

    transformers drops the keys of `_keys_to_ignore_on_load_missing` (core.py:31-38, e.g.
    input_norm.weight) from its report, so the key sets are compared here as well, and speculators
    NaN-initialises embed_tokens/lm_head (model.py:73-76) so that a tensor never loaded shows.
    """
    with safe_open(str(ckpt_dir / WEIGHTS_FILE), framework="pt") as f:
        in_checkpoint = set(f.keys())
    in_model = set(model.state_dict())
    if mismatched := sorted(info.get("mismatched_keys") or ()):
        shapes = "; ".join(f"{k}: checkpoint {tuple(c)} vs model {tuple(m)}" for k, c, m in mismatched)
        raise ValueError(f"speculators: size mismatch loading {shapes}")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in VERIFIER_OWNED and t.is_floating_point() and t.isnan().any():
            raise ValueError(f"speculators: {name} is still NaN after loading (never loaded)")
    if unused := sorted(in_checkpoint - in_model):
        raise ValueError(f"speculators: checkpoint tensors not loaded: {unused}")
    if missing := sorted(in_model - in_checkpoint - set(VERIFIER_OWNED)):
        raise ValueError(f"speculators: model tensors absent from the checkpoint: {missing}")


class LoadedSpeculators:
    def __init__(self, model, dtype: torch.dtype, loading_info: dict, device: str = "cpu"):
        self.model = model
        self.dtype = dtype
        self.loading_info = loading_info   # transformers' report: missing/unexpected/mismatched keys
        self.device = device

    @torch.no_grad()
    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """`record=False`: no stage hooks (a benchmark times the bare forward); the trace then holds
        only draft_ids and target_ids."""
        m, T = self.model, batch.input_ids.shape[0]
        batch = batch_on(batch, self.device)
        aux = batch.aux.to(self.dtype)
        rec = _Recorder(m, T) if record else contextlib.nullcontext()
        with rec:
            draft_tokens = m(
                hidden_states=aux[None],
                input_ids=batch.input_ids[None],
                document_ids=batch.seq_ids[None],
                position_ids=batch.positions[None],   # speculators adds 1 per TTT step (core.py:357)
                ttt_steps=steps,
            )
        trace = rec.steps if record else [{} for _ in draft_tokens]
        trace[0]["aux_in"] = aux
        for step, ids in enumerate(draft_tokens):
            draft = ids.reshape(T)
            # d2t holds offsets, speculators' own convention (train/vocab_mapping.py:98-99):
            # target = draft + d2t[draft]; no d2t when the draft vocabulary is the target's.
            target = draft if m.d2t is None else draft + m.d2t[draft]
            trace[step].update({"draft_ids": draft, "target_ids": target})
        notes = [
            f"speculators Eagle3DraftModel training forward, attention {m._attn_impl}"
            + (" (dense TTT mask)" if m._attn_impl == CPU_ATTENTION else ""),
            f"loading report: {_summary(self.loading_info)}",
        ]
        if steps > 1:
            notes.append("steps >= 1 are teacher-forced by speculators itself with its input_ids shifted "
                         "left by 1 + step over the whole packed row, 0-padded (core.py:332-338); "
                         "batch.next_ids is not used")
        return Trace(impl=SpeculatorsAdapter.name, dtype=self.dtype, steps=trace,
                     rows=[{} for _ in trace], notes=notes)


def _summary(info: dict) -> str:
    return ", ".join(f"{k}={sorted(v) if isinstance(v, (set, list)) else v}" for k, v in info.items() if v) or "clean"


class _Recorder:
    """Forward hooks that copy module inputs/outputs into per-TTT-step stage dicts.

    embed_tokens runs exactly once per TTT step (core.py:271), so its pre-hook opens each step after
    the first; fc and its input norms run once, before it, and land in step 0.
    """

    def __init__(self, model, T: int):
        self.model, self.T = model, T
        self.steps: list[dict[str, torch.Tensor]] = [{}]
        self.embed_calls = 0
        self.handles: list = []

    def put(self, stage: str, t: torch.Tensor, *shape: int) -> None:
        self.steps[-1][stage] = t.detach().reshape(self.T, *shape).clone()

    def out(self, stage: str, *shape: int):
        return lambda _m, _args, output: self.put(stage, output, *shape)

    def inp(self, stage: str, *shape: int):
        return lambda _m, args: self.put(stage, args[0], *shape)

    def __enter__(self):
        m, cfg = self.model, self.model.config.transformer_layer_config
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hooks = []   # (module, "pre" | "post", fn)

        def open_step(_m, args):
            if self.embed_calls:
                self.steps.append({})
            self.embed_calls += 1
            self.put("input_ids", args[0])

        hooks += [(m.embed_tokens, "pre", open_step), (m.embed_tokens, "post", self.out("embeds", -1))]
        if m.input_norm is not None:
            hooks.append((m.input_norm, "post", self.out("fc_in_norm", -1)))
        if m.fc_norm is not None:
            chunks: list[torch.Tensor] = []

            def fc_norm_chunk(_m, _args, output):
                chunks.append(output)
                if len(chunks) == len(m.fc_norm):   # the concatenation fc reads (core.py:239-243)
                    self.put("fc_in_norm", torch.cat(chunks, dim=-1), -1)

            hooks += [(norm, "post", fc_norm_chunk) for norm in m.fc_norm]
        hooks.append((m.fc, "post", self.out("fc_out", -1)))

        def hidden_fed_back(_m, args):
            if self.embed_calls > 1:   # steps >= 1: layer 0 reads cat([embeds, fed-back hidden]) (core.py:281)
                self.put("hidden_in", args[0].chunk(2, dim=-1)[1], -1)

        hooks.append((m.layers[0], "pre", hidden_fed_back))
        for i, layer in enumerate(m.layers):
            p, attn = f"layers.{i}.", layer.self_attn
            if i == 0:   # first layer: input_layernorm on the embeds, hidden_norm on the hidden
                hooks += [(layer.input_layernorm, "post", self.out(p + "embeds_norm", -1)),
                          (layer.hidden_norm, "post", self.out(p + "hidden_norm", -1))]
            else:
                hooks.append((layer.input_layernorm, "post", self.out(p + "hidden_norm", -1)))
            hooks += [
                (attn.q_proj, "pre", self.inp(p + "attn_in", -1)),
                (attn.q_proj, "post", self.out(p + "q", nh, hd)),
                (attn.k_proj, "post", self.out(p + "k", nkv, hd)),
                (attn.v_proj, "post", self.out(p + "v", nkv, hd)),
                (attn.o_proj, "pre", self.inp(p + "attn_core", -1)),
                (attn.o_proj, "post", self.out(p + "attn_out", -1)),
                (layer.post_attention_layernorm, "pre", self.inp(p + "post_attn", -1)),
                (layer.post_attention_layernorm, "post", self.out(p + "post_attn_norm", -1)),
                (layer.mlp, "post", self.out(p + "mlp_out", -1)),
                (layer, "post", self.out(p + "layer_out", -1)),
            ]
            self.handles.append(attn.register_forward_hook(self.cached_keys(p), with_kwargs=True))

        hooks += [(m.norm, "post", self.out("final_norm", -1)), (m.lm_head, "post", self.out("logits", -1))]
        # What the next TTT step is fed: the norm output when norm_output, else the last layer's
        # output (core.py:302-306).
        last = m.norm if m.config.norm_output else m.layers[-1]
        hooks.append((last, "post", self.out("recurrent_hidden", -1)))

        for module, kind, fn in hooks:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            self.handles.append(register(fn))
        return self

    def cached_keys(self, prefix: str):
        """k_rot: the post-RoPE keys this step appended to speculators' DynamicCache (its last T rows)."""
        def hook(attn, _args, kwargs, _output):
            cache = kwargs.get("past_key_values")
            if cache is not None:
                keys = cache.layers[attn.layer_idx].keys          # [1, nkv, S, hd], S = (step + 1) * T
                self.put(prefix + "k_rot", keys[0, :, -self.T:].transpose(0, 1), keys.shape[1], keys.shape[-1])
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
