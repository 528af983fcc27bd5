"""speculators 0.9.0's EAGLE-3 training model (`Eagle3DraftModel`), loaded and run in-process.

The checkpoint goes through speculators' own config class and its transformers loading path, the
TTT forward is speculators' own, and every stage is read by forward hooks (observation only) on its
modules, mapped to the canonical names of conformance/core/stages.py (`eagle3-semantics.md` §1.1).
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch
from safetensors import safe_open

from conformance.adapters.base import AdapterBase, Drafter, TimedPass, batch_on, last_rows

from conformance.core.trace import Trace
from conformance.adapters.speculators.recorder import Recorder
from conformance.adapters.speculators import training
from conformance.adapters.speculators.training import FLEX_BLOCK, training_layout
from conformance.checkpoints import WEIGHTS_FILE
from conformance.core import stages
from conformance.loading.accounting import (Accounting, load_and_count, observed_knobs, rope_text,
                                           vocab_map)
from reference.eagle3 import DraftBatch, Eagle3Config

# Only used by the training loss (verifier_last_hidden_states), which is never run here; they are
# filled from the verifier checkpoint, and this draft has none (verifier name_or_path is null).
VERIFIER_OWNED = ("verifier_lm_head.weight", "verifier_norm.weight")

# Local variables of speculators' code, not module inputs/outputs: the first layer's residual
# (model_definitions.py:75-81) and the post-RoPE query (LlamaAttention.forward).
NOT_OBSERVABLE = frozenset({"residual", "q_rot"})

# speculators' training attention on every device: flex attention over its own block masks
# (create_block_mask, extended per TTT step by extend_mask_for_draft_tokens; models/eagle3/core.py:47-60,
# 341-350), the default of its training CLI (train/config/schema.py:190-194). torch.compile wraps the
# forward on CUDA only (models/utils.py:71-76), so on CPU flex attention runs eagerly, unfused. It
# needs the packed rows padded as training pads them (training.training_layout).
TRAINING_ATTENTION = "simple_flex_attention"

# What a benchmark times, per step (training has no decode pass: step 1 is a TTT step over all rows).
TIMED = ("Eagle3DraftModel.forward(ttt_steps=1): fc + TTT step 0 over all B*L tokens",
         "TTT step 1 over all B*L tokens = forward(ttt_steps=2) - forward(ttt_steps=1) (training has no decode pass)")


class SpeculatorsAdapter(AdapterBase):
    name: ClassVar[str] = "speculators"
    package: ClassVar[str | None] = "speculators"
    checkpoint_format: ClassVar[str] = "speculators"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST) - NOT_OBSERVABLE
    draft_group: ClassVar[int | None] = 16   # its CPU attention is dense over the packed batch; 16 measured fastest
    serving_decode: ClassVar[bool] = False
    is_trainer: ClassVar[bool] = True
    training: ClassVar[ModuleType | None] = training   # its own training path: trains the acceptance area's draft
    releases: ClassVar[tuple[str, ...]] = ("0.8.0", "0.8.1", "0.9.0")   # the same draft code: no shim needed
    silent_drop: ClassVar[str | None] = None   # its loading is checked tensor by tensor: a drop is a refusal

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        # target_hidden_size != hidden_size is not refused here: speculators' own loader fails on
        # it (fc is A*hidden_size -> hidden_size, core.py:76-78), and that failure is the finding.
        if cfg.draft_arch == "mla":
            return ("speculators 0.9.0 has no MLA draft layer: its draft layers are llama or qwen3 "
                    "(speculators/models/eagle3/model_definitions.py:135-142)")
        return None

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        return True

    def dense_attention(self, device: str) -> bool:
        # Eager flex attention (CPU) materialises the scores over all padded rows; compiled (CUDA) it is block-sparse.
        return torch.device(device).type == "cpu"

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu", attention: str = TRAINING_ATTENTION) -> "LoadedSpeculators":
        # Imported here: speculators takes seconds to import and only this adapter needs it.
        from speculators.model import SpeculatorModel
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
        from speculators.models.eagle3.core import Eagle3DraftModel

        ckpt_dir = Path(ckpt_dir)
        config = Eagle3SpeculatorConfig.from_pretrained(ckpt_dir)
        config.transformer_layer_config._attn_implementation = attention
        if (config.transformer_layer_config.rope_parameters or {}).get("partial_rotary_factor", 1) < 1:
            # Stock HF apply_rotary_pos_emb cannot turn part of a head; speculators' training installs
            # its partial-neox patch for such drafts (train/cli.py:623-625, rotary_partial.py:73-92).
            from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
            install_partial_neox_rotary()
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
        return LoadedSpeculators(model, dtype, info, device, ckpt_dir)

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
        """speculators' transformers loader keys parameters by name; load()'s strict check raises on
        any tensor dropped or never loaded, so a refusal names them; success is verified by value."""
        ckpt_dir = Path(ckpt_dir)
        acct, ckpt, loaded = load_and_count(self.name, ckpt_dir, lambda: self.load(ckpt_dir, dtype))
        if loaded is None:
            return acct
        model = loaded.model
        acct.land_by_name(ckpt, model.state_dict(), frozenset(VERIFIER_OWNED))   # the teacher head is training-only
        acct.vocab_map = vocab_map(ckpt, model.embed_tokens.num_embeddings, model.lm_head.out_features)
        acct.uses = {"embed_tokens": "checkpoint (in training: the verifier's, unless embed_requires_grad)",
                     "lm_head": "checkpoint lm_head (in training: verifier lm_head[t2d], frozen; model.py:172-185)",
                     "d2t": "checkpoint d2t" if model.d2t is not None else "none (draft vocab = vocab)"}
        acct.knobs = knobs(loaded, ckpt)
        return acct


def knobs(loaded: "LoadedSpeculators", ckpt: dict[str, torch.Tensor]) -> dict:
    """The effective knob values, read from the loaded model's own modules and config, and what they do
    not state observed by running it (observed_knobs)."""
    model = loaded.model
    cfg = model.config
    tl = cfg.transformer_layer_config
    layer0 = model.layers[0]
    rope = model.rotary_emb
    seen = observed_knobs(loaded, model.fc.in_features, model.embed_tokens.num_embeddings, ckpt,
                          dict(model.named_parameters()))
    return {
        "aux states x width": f"{model.fc.in_features // tl.hidden_size} x {tl.hidden_size}",
        "fc": f"{model.fc.in_features} -> {model.fc.out_features}, {seen['fc']}",
        "norm_before_fc": model.input_norm is not None, "fc_norm": model.fc_norm is not None,
        "norm_before_residual": seen["norm_before_residual"],
        "norm_output": bool(cfg.norm_output),
        "layers": len(model.layers),
        "heads / kv heads / head_dim": f"{tl.num_attention_heads}/{tl.num_key_value_heads}/{tl.head_dim}",
        "rope": rope_text(rope.rope_type, rope.config.rope_parameters.get("rope_theta", 10000.0)),
        "q/k/v bias": layer0.self_attn.q_proj.bias is not None,
        "mlp bias": layer0.mlp.gate_proj.bias is not None,
        "sliding window": model.sliding_window if model.uses_sliding_window_attn else "none",
        "vocab / draft vocab": f"{model.embed_tokens.num_embeddings}/{model.lm_head.out_features}",
        "layers >= 1 pre-norm": seen["layers >= 1 pre-norm"],
    }


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
    if unused := sorted(in_checkpoint - in_model):
        raise ValueError(f"speculators: checkpoint tensors not loaded: {unused}")
    if missing := sorted(in_model - in_checkpoint - set(VERIFIER_OWNED)):
        raise ValueError(f"speculators: model tensors absent from the checkpoint: {missing}")
    # Last: the key sets decide first, so a tensor absent from the checkpoint is always reported as
    # such; a NaN scan of memory nothing wrote reads whatever the allocator left there.
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in VERIFIER_OWNED and t.is_floating_point() and t.isnan().any():
            raise ValueError(f"speculators: {name} is still NaN after loading (never loaded)")


class LoadedSpeculators:
    def __init__(self, model, dtype: torch.dtype, loading_info: dict, device: str = "cpu",
                 ckpt_dir: Path | None = None):
        self.model = model
        self.ckpt_dir = ckpt_dir
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
        inputs = training_layout(m, batch, aux, self.dtype)
        rows = inputs["input_ids"].shape[1]   # T, padded as training pads; only the first T are kept
        rec = Recorder(m, rows, T) if record else contextlib.nullcontext()
        with rec, warnings.catch_warnings():
            # "flex_attention called without torch.compile": on CPU the eager path is the point.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            # speculators adds 1 to position_ids per TTT step (core.py:357)
            draft_tokens = m(**inputs, ttt_steps=steps)
        trace = rec.steps if record else [{} for _ in draft_tokens]
        trace[0]["aux_in"] = aux
        for step, ids in enumerate(draft_tokens):
            draft = ids.reshape(rows)[:T]
            # d2t holds offsets, speculators' own convention (train/vocab_mapping.py:98-99):
            # target = draft + d2t[draft]; no d2t when the draft vocabulary is the target's.
            target = draft if m.d2t is None else draft + m.d2t[draft]
            trace[step].update({"draft_ids": draft, "target_ids": target})
        notes = [
            f"speculators Eagle3DraftModel training forward, attention {m._attn_impl} over its block masks, "
            f"packed rows zero-padded to a multiple of {FLEX_BLOCK} as its CollateFn pads (train/data.py:374-443)",
            f"loading report: {_summary(self.loading_info)}",
        ]
        if steps > 1:
            notes.append("steps >= 1 are teacher-forced by speculators itself with its input_ids shifted "
                         "left by 1 + step over the whole packed row, 0-padded (core.py:332-338); "
                         "batch.next_ids is not used")
        return Trace(impl=SpeculatorsAdapter.name, dtype=self.dtype, steps=trace, rows=[{} for _ in trace],
                     notes=notes, claimed_stages=SpeculatorsAdapter.claimed_stages, num_layers=len(m.layers))

    def timed_pass(self, batch: DraftBatch, step: int):
        """Step 1 has no pass of its own: the call runs TTT steps 0 and 1 (the benchmark subtracts step 0)."""
        return contextlib.nullcontext(TimedPass(lambda: self.run(batch, step + 1, record=False),
                                                tuple(range(step + 1)), TIMED[step]))

    def drafter(self) -> Drafter:
        """On CPU the simulation drafts with speculators' sdpa path: the same TTT forward over the same
        masks, dense (create_mask, extend_dense_mask_for_draft_tokens; core.py:53-59, 347-356), because
        eager flex attention costs about 60 ms a call in vmap overhead and the simulation makes over a
        thousand calls. The flex path is the one the conformance tests compare stage by stage, and the
        simulation's drafts are checked token by token against the reference's, so a difference between
        the two paths still fails there."""
        if torch.device(self.device).type != "cpu" or self.model._attn_impl != TRAINING_ATTENTION or not self.ckpt_dir:
            return teacher_forced_drafter(self)
        return teacher_forced_drafter(SpeculatorsAdapter().load(self.ckpt_dir, self.dtype, device=self.device,
                                                                attention="sdpa"))


def _summary(info: dict) -> str:
    return ", ".join(f"{k}={sorted(v) if isinstance(v, (set, list)) else v}" for k, v in info.items() if v) or "clean"


def teacher_forced_drafter(loaded: LoadedSpeculators) -> Drafter:
    """speculators drafts by teacher forcing only: TTT step k of row t embeds input_ids[t + k]
    (core.py:332-338). Its own drafts are fed back by appending them as rows after each request's
    last row and running again with one more step: K runs, the k-th with k steps.

    Why the appended rows never change the chain of the last row t (read in speculators 0.9.0): at
    step 0 row t attends to keys s <= t of its own document (attention.py:16-27: causal and document
    masks), at steps >= 1 in addition only to its own earlier-step keys, the diagonal blocks that
    extend_dense_mask_for_draft_tokens appends (attention.py:115-143); norms, MLP, fc and lm_head act
    per row. So all row t takes from a later row is the token input_ids[t + k] it embeds at step k:
    the draft d_k put there. The appended rows' own outputs are never read.
    """
    def draft(batch: DraftBatch, contexts: list[torch.Tensor], K: int) -> torch.Tensor:
        counts = torch.bincount(batch.seq_ids).tolist()
        first = torch.tensor([0] + counts[:-1]).cumsum(0).tolist()
        extra = K - 1
        grown_len = [c + extra for c in counts]
        grown_first = torch.tensor([0] + grown_len[:-1]).cumsum(0).tolist()
        own = torch.cat([torch.arange(c) + g for c, g in zip(counts, grown_first)])   # old row -> new row
        T = sum(grown_len)
        aux = batch.aux.new_zeros(T, batch.aux.shape[1])       # appended rows: zeros, never attended by t
        aux[own] = batch.aux
        input_ids = batch.input_ids.new_zeros(T)
        input_ids[own] = batch.input_ids
        positions = torch.cat([torch.arange(n) + batch.positions[f] for n, f in zip(grown_len, first)])
        seq_ids = torch.cat([torch.full((n,), j) for j, n in enumerate(grown_len)])
        last = own[last_rows(batch)]
        chain = []
        for k in range(K):
            grown = DraftBatch(aux=aux, input_ids=input_ids.clone(), positions=positions, seq_ids=seq_ids)
            d = loaded.run(grown, k + 1, record=False).steps[k]["target_ids"][last]
            chain.append(d)
            if k < extra:
                input_ids[last + k + 1] = d   # what row t embeds at step k + 1
        return torch.stack(chain, dim=1)
    return draft

