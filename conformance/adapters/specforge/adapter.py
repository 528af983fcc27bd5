"""SpecForge 0.2.0's EAGLE-3 draft (`LlamaForCausalLMEagle3`) and its TTT training forward
(`OnlineEagle3Model.forward`), loaded and run in-process on the draft's own device.

The draft is built as SpecForge's trainer builds it (algorithms/model_providers.py:91-112
build_eagle3_draft): the draft config through `load_draft_config_source`, `AutoDraftModel.from_config`
with the `sdpa` backend, then `warm_start_draft_model` (HF's from_pretrained only reads the state
dict there), and the whole model cast to the compute dtype. Not `AutoDraftModel.from_pretrained`:
under transformers 5.19 it leaves the rotary cache uninitialised (conformance/draft/test_specforge.py).

SpecForge trains on padded rows, one sequence per row, with no document ids: the sdpa path builds a
causal + padding mask only (model.py:340-347). So the packed batch is split into right-padded rows and
every stage is gathered back into packed order (recorder.py). Steps >= 1 are SpecForge's own teacher
forcing: input_ids shifted left by one per step *per row*, 0-padded (model.py:430), where the suite's
packed batch shifts across the whole packed row; the last k rows of each sequence are fed other ids at
step k, so a trace covers, at step k, the rows whose k-th next token is in their own sequence.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import ClassVar

import torch

from conformance.adapters.base import AdapterBase, Drafter, TimedPass, batch_on, last_rows
from conformance.core.trace import Trace, Unsupported
from conformance.adapters.specforge.recorder import Recorder
from conformance.adapters.specforge.shims import EAGER_NOTE, LOSS_NOTE, eager, torch_loss
from conformance.checkpoints.formats.specforge import inexpressible
from conformance.core import stages
from conformance.loading.accounting import Accounting, load_and_count, observed_knobs, rope_text, vocab_map
from reference.eagle3 import DraftBatch, Eagle3Config

# q_rot is a local of apply_rotary_pos_emb (llama3_eagle.py:133-142), a free compiled function; the
# keys after RoPE are observable in cache_hidden (k_rot). q_norm/k_norm: a Llama layer has none.
NOT_OBSERVABLE = frozenset({"q_rot", "q_norm", "k_norm"})

ATTENTION = "sdpa"   # the training CLI's default backend (config/schema.py); step 0 also takes its cache path

# What a benchmark times, per step (training has no decode pass: step 1 is a TTT step over all rows).
TIMED = ("OnlineEagle3Model.forward(length=1): fc + TTT step 0 over B padded rows",
         "TTT step 1 over B padded rows = forward(length=2) - forward(length=1) (training has no decode pass)")


class SpecForgeAdapter(AdapterBase):
    name: ClassVar[str] = "specforge"
    package: ClassVar[str | None] = "specforge"
    releases: ClassVar[tuple[str, ...]] = ("0.2.0",)
    is_trainer: ClassVar[bool] = True
    checkpoint_format: ClassVar[str] = "specforge"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST) - NOT_OBSERVABLE
    draft_group: ClassVar[int | None] = 16   # dense over [B, S] padded rows; per-call costs dominate: 16 fastest
    serving_decode: ClassVar[bool] = False
    silent_drop: ClassVar[str | None] = None   # warm_start_draft_model refuses unexpected keys (model_loading.py:436)

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        # One table with SpecForge's checkpoint format, which refuses to write the same knobs.
        reasons = [f"{knob}={getattr(cfg, knob)!r}: {why}" for knob, why in inexpressible(cfg).items()]
        return "SpecForge 0.2.0 cannot express " + "; ".join(reasons) if reasons else None

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        return True   # project_hidden_states always applies fc (llama3_eagle.py:1762-1769)

    def dense_attention(self, device: str) -> bool:
        # a hand-written matmul + additive mask over every padded row, on every device (llama3_eagle.py:741-760)
        return True

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedSpecForge":
        # Imported here: SpecForge takes seconds to import and only this adapter needs it. Its draft module
        # warns at import that flash_attn is absent (llama3_eagle.py:33); the sdpa backend used here needs none.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flash_attn is not found")
            from specforge.modeling.auto import AutoDraftModel
            from specforge.training.model_loading import load_draft_config_source, warm_start_draft_model

        ckpt_dir = Path(ckpt_dir)
        draft_config = load_draft_config_source(str(ckpt_dir))
        # HF initialises every parameter from the global generator before warm start overwrites them:
        # forked, so loading a draft never moves the random stream other tests draw from.
        with torch.random.fork_rng(), _quiet():
            torch.manual_seed(0)
            model = AutoDraftModel.from_config(draft_config, attention_backend=ATTENTION, torch_dtype=dtype)
            report = warm_start_draft_model(model, str(ckpt_dir), draft_config=draft_config, strategy="eagle3",
                                            allow_missing_embedding=True)
        # build_eagle3_draft casts the whole model, buffers included (model_providers.py:112).
        model = model.to(device=device, dtype=dtype).eval()
        return LoadedSpecForge(model, dtype, report, device)

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
        """warm_start_draft_model loads the state dict by name and refuses unexpected or missing keys
        (embed_tokens excepted, model_loading.py:436-450); success is verified by value here."""
        ckpt_dir = Path(ckpt_dir)
        acct, ckpt, loaded = load_and_count(self.name, ckpt_dir, lambda: self.load(ckpt_dir, dtype))
        if loaded is None:
            return acct
        model = loaded.model
        acct.land_by_name(ckpt, model.state_dict())
        acct.vocab_map = vocab_map(ckpt, model.vocab_size, model.draft_vocab_size)
        acct.uses = {"embed_tokens": "checkpoint" if loaded.report.loaded_embedding else
                     "its own initialisation (in training: the target's, load_embedding)",
                     "lm_head": "checkpoint lm_head",
                     "d2t": "checkpoint d2t (offsets, model.py:161-164)"}
        acct.knobs = knobs(loaded, ckpt)
        return acct


def knobs(loaded: "LoadedSpecForge", ckpt: dict[str, torch.Tensor]) -> dict:
    """The effective knob values, read from the built model's modules, and what they do not state
    observed by running it (observed_knobs)."""
    model = loaded.model
    attn = model.midlayer.self_attn
    rope = attn.rope_scaling or {}
    seen = observed_knobs(loaded, model.fc.in_features, model.vocab_size, ckpt, dict(model.named_parameters()))
    return {
        "aux states x width": f"3 x {model.target_hidden_size}",
        "fc": f"{model.fc.in_features} -> {model.fc.out_features}, {seen['fc']}",
        "norm_before_fc": False, "fc_norm": model.fc_norm is not None,
        "norm_before_residual": seen["norm_before_residual"],
        # The hidden fed back is the pre-norm output (model.py:397): training's norm_output False.
        "norm_output": False,
        "layers": 1,
        "heads / kv heads / head_dim": f"{attn.num_heads}/{attn.num_key_value_heads}/{attn.head_dim}",
        "rope": rope_text(rope.get("rope_type", rope.get("type", "default")), attn.rotary_emb.base),
        "q/k/v bias": attn.q_proj.bias is not None,
        "mlp bias": model.midlayer.mlp.gate_proj.bias is not None,
        "sliding window": "none",
        "vocab / draft vocab": f"{model.vocab_size}/{model.draft_vocab_size}",
        "layers >= 1 pre-norm": seen["layers >= 1 pre-norm"],
    }


@contextlib.contextmanager
def _quiet():
    """SpecForge logs every warm start at INFO; the trace notes carry the report instead."""
    log = logging.getLogger("specforge.training.model_loading")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


class PaddedRows:
    """The packed batch as SpecForge's trainer lays it out: one right-padded row per sequence."""

    def __init__(self, batch: DraftBatch, dtype: torch.dtype):
        counts = torch.bincount(batch.seq_ids.cpu()).tolist()
        first = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
        if [int(s) for s in batch.seq_ids.cpu()] != [j for j, n in enumerate(counts) for _ in range(n)]:
            raise ValueError("specforge: sequences must be contiguous and numbered 0, 1, ... in the packed batch")
        starts = batch.positions.cpu()[first]
        if bool(starts.any()):
            # rotary_emb(seq_len=q_len + lck) slices its cache to the row length, then indexes it at
            # position_ids + lck (llama3_eagle.py:730-733 -> :138): positions past the row length raise.
            raise Unsupported(f"SpecForge 0.2.0 cannot run sequences whose positions start at "
                              f"{sorted(set(starts.tolist()))} instead of 0: its TTT rotary cache is cut to the row "
                              "length (llama3_eagle.py:730-733, :138)")
        self.counts, self.B, self.S = counts, len(counts), max(counts)
        device = batch.input_ids.device
        rows = torch.cat([torch.arange(n) for n in counts]).to(device)
        if not torch.equal(batch.positions, rows):
            raise Unsupported("SpecForge 0.2.0 numbers each row's positions 0, 1, ... (model.py:203-214 with "
                              "its collator's rows); this batch's positions are not consecutive per sequence")
        which = batch.seq_ids
        self.packed = which * self.S + rows            # packed row -> flattened [B * S] row
        self.in_seq = rows                              # each packed row's index within its sequence
        self.length = torch.tensor(counts, device=device)[which]
        B, S = self.B, self.S
        self.input_ids = batch.input_ids.new_zeros(B * S)
        self.input_ids[self.packed] = batch.input_ids
        self.aux = batch.aux.new_zeros(B * S, batch.aux.shape[-1]).to(dtype)
        self.aux[self.packed] = batch.aux.to(dtype)
        mask = torch.zeros(B * S, dtype=torch.long, device=device)
        mask[self.packed] = 1
        # Padding keys are masked out; their positions continue the row so RoPE stays in range.
        self.positions = torch.arange(S, device=device).repeat(B)
        self.input_ids, self.aux = self.input_ids.view(B, S), self.aux.view(B, S, -1)
        self.attention_mask, self.positions = mask.view(B, S), self.positions.view(B, S)

    def covered(self, step: int) -> torch.Tensor:
        """The packed rows whose step-`step` token is their own sequence's (not SpecForge's 0 padding)."""
        return (self.in_seq + step < self.length).nonzero().flatten()


class LoadedSpecForge:
    def __init__(self, model, dtype: torch.dtype, report, device: str = "cpu"):
        self.model = model
        self.dtype = dtype
        self.report = report   # warm_start_draft_model's WarmStartReport
        self.device = device

    def forward(self, rows: PaddedRows, steps: int, record: bool) -> list[dict[str, torch.Tensor]]:
        """SpecForge's TTT forward on the padded rows; per step, every stage over all packed rows."""
        from specforge.algorithms.eagle3.model import OnlineEagle3Model

        m = self.model
        ttt = OnlineEagle3Model(m, length=steps, attention_backend=ATTENTION)
        # The teacher's logits only feed the loss: zeros (any [B, S, V] would do).
        target = torch.zeros(rows.B, rows.S, m.vocab_size, device=rows.aux.device)
        rec = Recorder(m, rows.B, rows.S, rows.packed)
        with torch.no_grad(), torch_loss(), eager(), rec:
            ttt(input_ids=rows.input_ids, attention_mask=rows.attention_mask, target=target,
                loss_mask=rows.attention_mask[..., None], hidden_states=rows.aux, position_ids=rows.positions)
        trace = rec.steps
        for step in trace:
            draft = step["logits"].argmax(-1)
            # d2t holds offsets: target = draft + d2t[draft] (model.py:161-164).
            step.update(draft_ids=draft, target_ids=draft + m.d2t[draft])
        if not record:
            trace = [{k: s[k] for k in ("draft_ids", "target_ids")} for s in trace]
        return trace

    @torch.no_grad()
    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """`record=False`: the trace holds only draft_ids and target_ids (SpecForge's stages are read
        by hooks either way: the hooks are its only output besides the loss)."""
        batch = batch_on(batch, self.device)
        rows = PaddedRows(batch, self.dtype)
        trace = self.forward(rows, steps, record)
        if record:
            trace[0]["aux_in"] = batch.aux.to(self.dtype)
        covered = [{} if k == 0 else dict.fromkeys(s, rows.covered(k)) for k, s in enumerate(trace)]
        trace = [s if k == 0 else {name: t[covered[k][name]] for name, t in s.items()} for k, s in enumerate(trace)]
        notes = [
            f"SpecForge OnlineEagle3Model.forward (attention backend {ATTENTION}), the packed batch as "
            f"{rows.B} right-padded rows of {rows.S} (one sequence per row: its sdpa mask is causal + padding, "
            "model.py:340-347)",
            f"warm start: {self.report.loaded_keys} tensors ({self.report.checkpoint_format}), "
            f"missing {list(self.report.missing_keys) or 'none'}",
            LOSS_NOTE, EAGER_NOTE,
        ]
        if steps > 1:
            notes.append("steps >= 1 are teacher-forced by SpecForge itself, its input_ids shifted left by one per "
                         "step per row, 0-padded (model.py:430); step k covers the rows whose k-th next token is "
                         "in their own sequence (the suite's packed batch shifts across sequences)")
        return Trace(impl=SpecForgeAdapter.name, dtype=self.dtype, steps=trace, rows=covered, notes=notes,
                     claimed_stages=SpecForgeAdapter.claimed_stages, num_layers=1)

    def timed_pass(self, batch: DraftBatch, step: int):
        """Step 1 has no pass of its own: the call runs TTT steps 0 and 1 (the benchmark subtracts step 0)."""
        rows = PaddedRows(batch_on(batch, self.device), self.dtype)
        return contextlib.nullcontext(TimedPass(lambda: self.forward(rows, step + 1, record=False),
                                                tuple(range(step + 1)), TIMED[step]))

    def drafter(self) -> Drafter:
        return teacher_forced_drafter(self)


def teacher_forced_drafter(loaded: LoadedSpecForge) -> Drafter:
    """SpecForge drafts by teacher forcing only: TTT step k of row t embeds row t + k of its own
    padded row (model.py:430). Its own drafts are fed back by appending K - 1 rows after each
    request's last row and running again with one more step: K runs, the k-th with k steps.

    The appended rows never change the chain of the last row t: at step 0 row t attends to keys
    s <= t of its own row (prepare_decoder_attention_mask: causal + padding), at steps >= 1 in
    addition only to its own earlier-step keys (the diagonal, llama3_eagle.py:745-760); norms, MLP,
    fc and lm_head act per row. All row t takes from a later row is the token it embeds at step k.
    """
    def draft(batch: DraftBatch, contexts: list[torch.Tensor], K: int) -> torch.Tensor:
        counts = torch.bincount(batch.seq_ids).tolist()
        extra = K - 1
        grown_len = [c + extra for c in counts]
        grown_first = torch.tensor([0] + grown_len[:-1]).cumsum(0).tolist()
        own = torch.cat([torch.arange(c) + g for c, g in zip(counts, grown_first)])   # old row -> new row
        T = sum(grown_len)
        aux = batch.aux.new_zeros(T, batch.aux.shape[1])
        aux[own] = batch.aux
        input_ids = batch.input_ids.new_zeros(T)
        input_ids[own] = batch.input_ids
        positions = torch.cat([torch.arange(n) for n in grown_len])
        seq_ids = torch.cat([torch.full((n,), j) for j, n in enumerate(grown_len)])
        last = own[last_rows(batch)]
        chain = []
        for k in range(K):
            grown = DraftBatch(aux=aux, input_ids=input_ids.clone(), positions=positions, seq_ids=seq_ids)
            d = loaded.forward(PaddedRows(batch_on(grown, loaded.device), loaded.dtype), k + 1, False)[k]["target_ids"]
            chain.append(d[last])
            if k < extra:
                input_ids[last + k + 1] = d[last]   # what row t embeds at step k + 1
        return torch.stack(chain, dim=1)
    return draft
