"""The reference as an adapter: reads the speculators-format directory (training semantics)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar

import torch

from conformance.adapters.base import AdapterBase, Drafter, TimedPass, batch_on, chain_drafter

from conformance.core.trace import Trace
from conformance.checkpoints import read_config, read_weights
from conformance.core import stages
from conformance.loading.accounting import (Accounting, checkpoint_tensors, mla_text, observed_knobs, rope_text,
                                            vocab_map)
from reference.eagle3 import DraftBatch, Eagle3Config, Eagle3Reference

# What a benchmark times, per step (the reference has no decode pass: step 1 is a TTT step over all rows).
TIMED = ("Eagle3Reference.run(steps=1): fc + one pass over all B*L tokens",
         "TTT step 1 over all B*L tokens = run(steps=2) - run(steps=1) (the reference has no decode pass)")


class ReferenceAdapter(AdapterBase):
    name: ClassVar[str] = "reference"
    package: ClassVar[str | None] = None   # this project's own code
    checkpoint_format: ClassVar[str] = "speculators"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST)
    draft_group: ClassVar[int | None] = 4   # its attention is dense over the packed batch: small groups are faster
    serving_decode: ClassVar[bool] = False
    releases: ClassVar[tuple[str, ...]] = ()   # not a package: nothing to test it against
    silent_drop: ClassVar[str | None] = "the reference's forward never reads it (reference/eagle3.py)"

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        return True

    def dense_attention(self, device: str) -> bool:
        return True   # explicit masks and scores over all packed rows, on every device

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedReference":
        weights = {k: v.to(device) for k, v in read_weights(ckpt_dir).items()}
        return LoadedReference(Eagle3Reference(read_config(ckpt_dir), weights, dtype), device)

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
        """The reference reads tensors by name; a recording dict lists the ones one forward really reads."""
        from fixtures.tiny import make_batch

        ckpt_dir = Path(ckpt_dir)
        acct = Accounting(self.name)
        ckpt = checkpoint_tensors(ckpt_dir)
        acct.tensors = len(ckpt)
        loaded = self.load(ckpt_dir, dtype)
        model = loaded.model
        read: set[str] = set()

        class Recording(dict):
            def __getitem__(self, key):
                read.add(key)
                return super().__getitem__(key)

            def get(self, key, default=None):
                if key in self:
                    read.add(key)
                return super().get(key, default)

        model.w = Recording(model.w)
        cfg = model.cfg
        model.run(make_batch(cfg, (3,), torch.Generator().manual_seed(0)), 1)
        for name in sorted(ckpt):
            if name in read:
                acct.land(name, name, model.w[name], ckpt[name])
            elif name not in ("t2d",):   # t2d is implied by d2t; the reference maps ids with d2t only
                acct.dropped.append(name)
            else:
                acct.ignored.append(name)
        acct.uses = {"embed_tokens": "checkpoint" if "embed_tokens.weight" in read else "absent",
                     "lm_head": "embed_tokens (tied)" if cfg.tie_word_embeddings else "checkpoint lm_head",
                     "d2t": "checkpoint d2t" if "d2t" in read else "none (draft vocab = vocab)"}
        acct.knobs = knobs(loaded, ckpt)
        acct.vocab_map = vocab_map(ckpt, cfg.vocab_size, cfg.draft_vocab_size)
        return acct


def knobs(loaded: "LoadedReference", ckpt: dict[str, torch.Tensor]) -> dict:
    """The effective knob values: the reference runs the config as written; what the config does not
    state by name is observed by running it, as for every implementation (observed_knobs)."""
    cfg = loaded.model.cfg
    seen = observed_knobs(loaded, cfg.num_aux_hidden_states * cfg.target_hidden_size, cfg.vocab_size, ckpt,
                          loaded.model.w)
    return {
        "aux states x width": f"{cfg.num_aux_hidden_states} x {cfg.target_hidden_size}",
        "fc": f"{cfg.num_aux_hidden_states * cfg.target_hidden_size} -> {cfg.hidden_size}, {seen['fc']}",
        "norm_before_fc": cfg.norm_before_fc, "fc_norm": cfg.fc_norm,
        "norm_before_residual": seen["norm_before_residual"], "norm_output": cfg.norm_output,
        "layers": cfg.num_hidden_layers, "heads / kv heads / head_dim":
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}/{cfg.head_dim}",
        **({"mla": mla_text(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim)} if cfg.draft_arch == "mla" else {}),
        "rope": rope_text((cfg.rope_scaling or {}).get("rope_type", "default"), cfg.rope_theta),
        "q/k/v bias": cfg.attention_bias, "mlp bias": cfg.mlp_bias,
        "sliding window": cfg.sliding_window or "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{cfg.draft_vocab_size}",
        "layers >= 1 pre-norm": seen["layers >= 1 pre-norm"],
    }


class LoadedReference:
    def __init__(self, model: Eagle3Reference, device: str = "cpu"):
        self.model = model
        self.device = device

    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """`record` changes nothing: the reference's stages are its own computation, not hooks."""
        # The reference creates its masks and RoPE tables with factory functions (torch.eye, arange):
        # torch's default-device context puts them next to the weights without touching its code
        # (not entered on the CPU, where it would only add a dispatch cost to every op).
        on_cpu = torch.device(self.device).type == "cpu"
        with contextlib.nullcontext() if on_cpu else torch.device(self.device):
            trace = self.model.run(batch_on(batch, self.device), steps)
        return Trace(impl=ReferenceAdapter.name, dtype=self.model.dtype, steps=trace, rows=[{} for _ in range(steps)],
                     claimed_stages=ReferenceAdapter.claimed_stages, num_layers=self.model.cfg.num_hidden_layers)

    def timed_pass(self, batch: DraftBatch, step: int):
        """Step 1 has no pass of its own: the call runs steps 0 and 1 (the benchmark subtracts step 0)."""
        return contextlib.nullcontext(TimedPass(lambda: self.run(batch, step + 1), tuple(range(step + 1)), TIMED[step]))

    def drafter(self) -> Drafter:
        return chain_drafter(self)
