"""NeMo Automodel 0.7.0's EAGLE-3 draft (`LlamaEagle3DraftModel`, draft_llama.py) and its TTT training forward
(`Eagle3TrainerModule.forward`, core.py), loaded and run in-process on the draft's own device.

The draft is built as the EAGLE-3 recipe builds it (the draft's config class from its config.json,
`LlamaEagle3DraftModel(config).to(dtype)`, train_eagle3.py:610-659) and loaded by NeMo's own checkpointer
(`Checkpointer.load_model`, checkpoint.py here). The batch is laid out as NeMo's sequence packing lays it out
(datasets/llm/eagle3.py build_packed_eagle3_dataset and its collate): one row [1, T] of the sequences back to
back, `seq_lens` per document (a block-causal mask, draft_llama.py:974-979), `doc_remaining` gating the
supervision. The TTT loop is NeMo's own: its `cache_hidden` recurrence, `position_ids + step` for RoPE
(draft_llama.py:317-319), input ids shifted left by one per step over the whole packed row, 0-filled
(core.py:_shift_left_with_zero), exactly the suite's teacher-forced ids. No runtime adjustment: on CPU its
loss is plain torch (loss/soft_ce.py:56-57 takes the Triton kernel on CUDA only) and its attention is eager.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Callable, ClassVar, Mapping

import torch

from conformance.adapters.base import AdapterBase, Drafter, TimedPass, batch_on
from conformance.adapters.nemo import training, wiring
from conformance.adapters.nemo.checkpoint import load_with_nemo, prepare_for_sglang, quiet, save_with_nemo
from conformance.adapters.nemo.recorder import Recorder
from conformance.adapters.speculators.adapter import teacher_forced_drafter
from conformance.checkpoints import read_weights
from conformance.checkpoints.formats.nemo import inexpressible
from conformance.core import stages
from conformance.core.trace import Trace, Unsupported
from conformance.loading.accounting import (Accounting, load_and_count, mla_text, observed_knobs, rope_text,
                                            vocab_map)
from reference.eagle3 import DraftBatch, Eagle3Config

# q_rot is a local of Eagle3LlamaAttention.forward (draft_llama.py:319-320, apply_rotary_pos_emb is a free
# function); the keys after RoPE are observable in cache_hidden (k_rot). q_norm/k_norm: a Llama layer has none.
NOT_OBSERVABLE = frozenset({"q_rot", "q_norm", "k_norm"})

# What a benchmark times, per step (training has no decode pass: step 1 is a TTT step over all rows).
TIMED = ("Eagle3TrainerModule.forward(ttt_steps=1): fc + TTT step 0 over the packed row",
         "TTT step 1 over the packed row = forward(ttt_steps=2) - forward(ttt_steps=1) (training has no decode pass)")


class NemoAdapter(AdapterBase):
    name: ClassVar[str] = "nemo"
    package: ClassVar[str | None] = "nemo-automodel"
    releases: ClassVar[tuple[str, ...]] = ("0.7.0",)
    is_trainer: ClassVar[bool] = True
    checkpoint_format: ClassVar[str] = "nemo"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST) - NOT_OBSERVABLE
    draft_group: ClassVar[int | None] = 8   # its eager attention is dense over the whole packed row
    serving_decode: ClassVar[bool] = False
    training: ClassVar[ModuleType | None] = training   # its own training path: trains a draft for the acceptance bridge
    training_capture: ClassVar[ModuleType | None] = wiring   # its HF target and its SGLang runner (wiring.py)
    save_checkpoint: ClassVar[Callable[..., Path] | None] = staticmethod(save_with_nemo)   # its checkpointer
    # its own SGLang helper (serve_sglang.py): the directory its users serve with SGLang
    prepare_for_server: ClassVar[Mapping[str, Callable[[Path], Path]]] = MappingProxyType(
        {"sglang": prepare_for_sglang})
    # Checkpointer.load_model reads the draft's own keys through DCP (torch/distributed/checkpoint/
    # default_planner.py create_default_local_load_plan): a missing one raises, an extra one is never read.
    silent_drop: ClassVar[str | None] = ("Checkpointer.load_model reads only the draft's own keys through torch DCP "
                                         "(nemo_automodel/components/checkpoint/checkpointing.py:1001-1009, "
                                         "torch/distributed/checkpoint/default_planner.py); a checkpoint tensor "
                                         "the draft has no parameter for is never read, without a word")

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        # One table with NeMo's checkpoint format, which refuses to write the same knobs.
        reasons = [f"{knob}={getattr(cfg, knob)!r}: {why}" for knob, why in inexpressible(cfg).items()]
        return "NeMo Automodel 0.7.0 cannot express " + "; ".join(reasons) if reasons else None

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        return True   # project_hidden_states always applies fc (draft_llama.py:900-922)

    def dense_attention(self, device: str) -> bool:
        # eager matmul + additive block-causal mask over the whole packed row (draft_llama.py:379-417)
        return True

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedNemo":
        return LoadedNemo(load_with_nemo(Path(ckpt_dir), dtype, device), dtype, device)

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
        """NeMo's checkpointer loads by name (DCP); every checkpoint tensor is followed to the parameter of its
        name and verified by value; one the draft has no parameter for is dropped silently (`silent_drop`)."""
        ckpt_dir = Path(ckpt_dir)
        acct, _, loaded = load_and_count(self.name, ckpt_dir, lambda: self.load(ckpt_dir, dtype))
        if loaded is None:
            return acct
        model = loaded.model
        ckpt = read_weights(ckpt_dir, stored_names=True)
        acct.land_by_name(ckpt, model.state_dict())
        acct.vocab_map = vocab_map(ckpt, model.config.vocab_size, model.draft_vocab_size)
        acct.uses = {"embed_tokens": "checkpoint (in training: the target's, copy_embeddings_from_target, frozen)",
                     "lm_head": "checkpoint lm_head",
                     "d2t": "checkpoint d2t (offsets, set_vocab_mapping draft_llama.py:853-871)"
                            if model.has_vocab_compression else "none (draft vocab = vocab)"}
        acct.knobs = knobs(loaded, ckpt)
        return acct


def knobs(loaded: "LoadedNemo", ckpt: dict[str, torch.Tensor]) -> dict:
    """The effective knob values, read from the built model's modules and config, and what they do not state
    observed by running it (observed_knobs)."""
    model = loaded.model
    cfg, inner = model.config, model.model
    attn = inner.layers[0].self_attn
    seen = observed_knobs(loaded, inner.fc.in_features, cfg.vocab_size, ckpt, dict(model.named_parameters()))
    scaling = getattr(cfg, "rope_parameters", None) or {}
    mla = hasattr(attn, "kv_lora_rank")   # DeepseekV3Eagle3DraftModel's MLA attention (draft_deepseek.py:82-132)
    projections = [m for m in attn.children() if isinstance(m, torch.nn.Linear) and m is not attn.o_proj]
    return {
        "aux states x width": f"{inner.fc.in_features // model.target_hidden_size} x {model.target_hidden_size}",
        "fc": f"{inner.fc.in_features} -> {inner.fc.out_features}, {seen['fc']}",
        "norm_before_fc": False, "fc_norm": getattr(inner, "fc_norm", None) is not None,
        "norm_before_residual": seen["norm_before_residual"],
        "norm_output": bool(getattr(cfg, "norm_output", False)),
        "layers": len(inner.layers),
        # MLA: every head attends the shared latent; head_dim is the rope slice, as DeepseekV3Config states it
        "heads / kv heads / head_dim": f"{attn.num_heads}/{attn.num_heads}/{attn.qk_rope_head_dim}" if mla else
                                       f"{attn.num_heads}/{attn.num_key_value_heads}/{attn.head_dim}",
        **({"mla": mla_text(attn.q_lora_rank, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                            attn.v_head_dim)} if mla else {}),
        "rope": rope_text(scaling.get("rope_type", "default"), scaling.get("rope_theta")),
        "q/k/v bias": any(m.bias is not None for m in projections),
        "mlp bias": inner.layers[0].mlp.gate_proj.bias is not None,
        "sliding window": "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{model.draft_vocab_size}",
        "layers >= 1 pre-norm": seen["layers >= 1 pre-norm"],
    }


class PackedRow:
    """The packed batch as NeMo's sequence packing lays it out (datasets/llm/eagle3.py:42-142): its own packer
    and collate on the batch's sequences, one row of exactly T tokens (no padding)."""

    def __init__(self, batch: DraftBatch, dtype: torch.dtype):
        from nemo_automodel.components.datasets.llm.eagle3 import _pack_collate, build_packed_eagle3_dataset

        seq_ids = batch.seq_ids.cpu()
        counts = torch.bincount(seq_ids).tolist()
        if seq_ids.tolist() != [j for j, n in enumerate(counts) for _ in range(n)]:
            raise ValueError("nemo: sequences must be contiguous and numbered 0, 1, ... in the packed batch")
        T = sum(counts)
        ids = batch.input_ids.cpu().split(counts)
        docs = [{"input_ids": d.tolist(), "loss_mask": [1] * len(d)} for d in ids]
        packs = build_packed_eagle3_dataset(docs, packed_sequence_size=T, pad_token_id=0)
        if len(packs) != 1:
            raise Unsupported(f"NeMo's packer split {len(counts)} sequences of {T} tokens into {len(packs)} rows")
        device = batch.input_ids.device
        row = {k: v.to(device) for k, v in _pack_collate(packs).items()}
        self.own_positions = row.pop("position_ids")   # each document from 0 (eagle3.py:118)
        # The draft takes the batch's own positions: the same unless a case starts its sequences elsewhere.
        self.positions = batch.positions[None]
        self.row = row
        self.aux = batch.aux.to(dtype)[None]
        self.T = T


class LoadedNemo:
    def __init__(self, model, dtype: torch.dtype, device: str = "cpu"):
        self.model = model.eval()
        self.dtype = dtype
        self.device = device

    def trainer(self, steps: int):
        """NeMo's TTT trainer module around the loaded draft, with the draft vocabulary its d2t/t2d state
        (set_vocab_mapping's inverse: selected ids = arange + d2t, their mask = t2d)."""
        from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule

        m = self.model
        if m.has_vocab_compression:
            selected = torch.arange(m.draft_vocab_size, device=m.d2t.device) + m.d2t
            mask = m.t2d
        else:
            selected = torch.arange(m.config.vocab_size, device=self.device)
            mask = torch.ones(m.config.vocab_size, dtype=torch.bool, device=self.device)
        return Eagle3TrainerModule(m, selected_token_ids=selected, selected_token_mask=mask, ttt_steps=steps)

    def forward(self, packed: PackedRow, steps: int, record: bool) -> list[dict[str, torch.Tensor]]:
        """NeMo's TTT forward on the packed row; per step, every stage (or draft/target ids only)."""
        m = self.model
        # The teacher's logits only feed the loss and its metrics: zeros (any [1, T, V] would do).
        target = torch.zeros(1, packed.T, m.config.vocab_size, device=packed.aux.device)
        rec = Recorder(m)
        with torch.no_grad(), rec, quiet():
            self.trainer(steps)(input_ids=packed.row["input_ids"], attention_mask=packed.row["attention_mask"],
                                loss_mask=packed.row["loss_mask"], aux_hidden_states=packed.aux, target_logits=target,
                                position_ids=packed.positions, seq_lens=packed.row["seq_lens"],
                                doc_remaining=packed.row["doc_remaining"])
        trace = rec.steps
        for step in trace:
            draft = step["logits"].argmax(-1)
            # d2t holds offsets: target = draft + d2t[draft] (set_vocab_mapping, draft_llama.py:866-868).
            step.update(draft_ids=draft, target_ids=draft + m.d2t[draft] if m.has_vocab_compression else draft)
        if not record:
            trace = [{k: s[k] for k in ("draft_ids", "target_ids")} for s in trace]
        return trace

    @torch.no_grad()
    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """`record=False`: the trace holds only draft_ids and target_ids (NeMo's stages are read by hooks
        either way: besides them, its forward returns only the loss and metrics)."""
        batch = batch_on(batch, self.device)
        packed = PackedRow(batch, self.dtype)
        trace = self.forward(packed, steps, record)
        if record:
            trace[0]["aux_in"] = packed.aux[0]
        notes = [
            f"NeMo Automodel Eagle3TrainerModule.forward ({steps} TTT steps, eager attention), the packed batch as "
            f"its sequence packing lays it out: one row of {packed.T}, seq_lens {packed.row['seq_lens'][0].tolist()} "
            "(block-causal mask, draft_llama.py:974-979), doc_remaining gating the loss",
            "loaded by NeMo's Checkpointer.load_model into LlamaEagle3DraftModel built as train_eagle3.py:610-659",
        ]
        if not torch.equal(packed.positions, packed.own_positions):
            notes.append("position_ids are the batch's; NeMo's packer numbers each document from 0 (eagle3.py:118)")
        if steps > 1:
            notes.append("steps >= 1 are teacher-forced by NeMo itself, its input_ids shifted left by one per step "
                         "over the whole packed row, 0-filled (core.py _shift_left_with_zero); next_ids is not used")
        return Trace(impl=NemoAdapter.name, dtype=self.dtype, steps=trace, rows=[{} for _ in trace], notes=notes,
                     claimed_stages=NemoAdapter.claimed_stages, num_layers=len(self.model.model.layers))

    def timed_pass(self, batch: DraftBatch, step: int):
        """Step 1 has no pass of its own: the call runs TTT steps 0 and 1 (the benchmark subtracts step 0)."""
        packed = PackedRow(batch_on(batch, self.device), self.dtype)
        return contextlib.nullcontext(TimedPass(lambda: self.forward(packed, step + 1, record=False),
                                                tuple(range(step + 1)), TIMED[step]))

    def drafter(self) -> Drafter:
        """NeMo drafts by teacher forcing only, as speculators does: TTT step k of row t embeds the packed row's
        token t + k (core.py _shift_left_with_zero), row t attends the keys of its own document up to itself
        at step 0 (seq_lens' block-causal mask) and its own earlier-step keys after (the diagonal,
        draft_llama.py:379-417); so speculators' appended-rows drafter holds for it unchanged."""
        return teacher_forced_drafter(self)
