"""The user's draft as a DraftStore case: the same conformance path (traces, compare, accounting) as the
tiny cases, on copies of the user's files in each implementation's format.

SGLang-family directories (SGLang's format, its legacy names, SpecForge's export) are given to SGLang
as written; any other format goes through this suite's converter, and the verdict's first problem
says so (conformance/user/servable.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from conformance.adapters import ADAPTERS
from conformance.checkpoints.directory import write_draft
from conformance.checkpoints.hidden_states import TinyTarget, read_dump, uses_tiny_target
from conformance.checkpoints.knobs import CONFIG_FILE
from conformance.checkpoints.training_data import MAX_TOKENS, Sample, first_samples, make_data_batch, make_samples
from conformance.checkpoints.weights import WEIGHTS_FILE, read_weights
from conformance.core.harness import DraftStore
from conformance.user.user_draft import SEED, USER_CASE_ID, UserInputs, user_case
from fixtures.cases import DraftCase
from reference.eagle3 import Eagle3Config

SGLANG_FAMILY = ("sglang", "sglang-legacy", "specforge")   # formats SGLang loads as they are
RANDOM_LENGTHS = (9, 5, 12)                 # token counts when no training data is given


def used_samples(inputs: UserInputs) -> list[Sample]:
    if inputs.samples is not None:
        return first_samples(inputs.samples)
    ids = make_samples(inputs.config, tuple(n + 1 for n in RANDOM_LENGTHS), torch.Generator().manual_seed(SEED + 1))
    return [Sample(0, tuple(s), (0,) * len(s), len(s), "seeded random") for s in ids]


class UserDraftStore(DraftStore):
    """A DraftStore whose `user_draft` case is the user's checkpoint and inputs (other cases as usual)."""

    def __init__(self, root: Path, inputs: UserInputs):
        super().__init__(root)
        self.inputs = inputs
        self.samples = used_samples(inputs)
        self.aux_source = ""
        self._aux: list[torch.Tensor] | None = None
        self._accounts: dict | None = None
        self.reported = False
        self.case = user_case(inputs.config, tuple(len(s.input_ids) - 1 for s in self.samples), inputs.source)

    @property
    def converted(self) -> bool:
        """Whether SGLang gets this suite's conversion instead of the directory as written."""
        return self.inputs.checkpoint.format not in SGLANG_FAMILY

    def is_user(self, case: DraftCase) -> bool:
        """The user's case, or a relabelled copy of it (e.g. the multi-step run's)."""
        return case.id.startswith(USER_CASE_ID) and case.overrides == self.case.overrides

    def checkpoint(self, case: DraftCase) -> dict[str, Path]:
        """Copies in each implementation's format. SGLang-family drafts keep their own config.json and
        tensor names, so SGLang reads them exactly as it would serve them (its legacy names, its
        reading of norm_output, ...); other formats go through this suite's converter
        (conformance/checkpoints/directory.py)."""
        if not self.is_user(case):
            return super().checkpoint(case)
        case = self.case
        if case.id not in self._checkpoints:
            src, cfg = self.inputs.checkpoint, self.inputs.config
            weights = read_weights(src.path)
            if "embed_tokens.weight" not in weights:
                dtype = weights["fc.weight"].dtype
                weights["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64,
                                                             generator=torch.Generator().manual_seed(SEED)).to(dtype)
            root = self.root / case.id
            dirs = {"speculators": write_draft(cfg, weights, root / "speculators", "speculators")}
            if src.format in SGLANG_FAMILY:
                dirs["sglang"] = root / "sglang"
                dirs["sglang"].mkdir(parents=True, exist_ok=True)
                stored = {src.tensors[k].stored_name if k in src.tensors else k: v.contiguous()
                          for k, v in weights.items()}
                save_file(stored, str(dirs["sglang"] / WEIGHTS_FILE), metadata={"format": "pt"})
                shutil.copyfile(src.path / CONFIG_FILE, dirs["sglang"] / CONFIG_FILE)
            else:
                dirs["sglang"] = write_draft(cfg, weights, root / "sglang", "sglang")
            self._checkpoints[case.id] = dirs
        return self._checkpoints[case.id]

    def aux(self) -> list[torch.Tensor]:
        """Aux states per used sample: from the dump, from the tiny target, or seeded random."""
        if self._aux is None:
            cfg, samples = self.inputs.config, self.samples
            A, Ht = cfg.num_aux_hidden_states, cfg.target_hidden_size
            if self.inputs.hidden_states is not None:
                full = read_dump(self.inputs.hidden_states, self.inputs.samples[:len(samples)], cfg)
                self._aux = [a[: len(s.input_ids) - 1] for a, s in zip(full, samples)]
                self.aux_source = "hidden-state dump (speculators datagen layout)"
            elif self.inputs.samples is not None and uses_tiny_target(cfg):
                target = TinyTarget(cfg, torch.Generator().manual_seed(SEED + 2))
                self._aux = [target.hidden_states(list(s.input_ids))[:-1, :A].flatten(1).double() for s in samples]
                layers = target.model.config.num_hidden_layers
                self.aux_source = f"tiny random target (layers {list(target.aux_layer_ids)} of {layers})"
            else:
                g = torch.Generator().manual_seed(SEED + 3)
                self._aux = [torch.randn(len(s.input_ids) - 1, A * Ht, generator=g, dtype=torch.float64)
                             for s in samples]
                self.aux_source = "seeded random"
        return self._aux

    def batch(self, case: DraftCase, steps: int = 1, teacher_forced: bool = True):
        if not self.is_user(case):
            return super().batch(case, steps, teacher_forced)
        return make_data_batch(self.inputs.config, self.samples, self.aux(), steps, teacher_forced)

    def accounts(self) -> dict:
        """Weight accounting of the user's draft per implementation (fp32), computed once."""
        from conformance.loading.accounting import account

        if self._accounts is None:
            dirs = self.checkpoint(self.case)
            self._accounts = {impl: account(impl, dirs[adapter.checkpoint_format], torch.float32, self.inputs.target)
                              for impl, adapter in ADAPTERS.items()}
        return self._accounts

    def report_rows(self) -> list[dict]:
        """What ran, for the report's "bring your own draft" section (no temp paths)."""
        inputs, cfg = self.inputs, self.inputs.config
        self.aux()
        rows = [{"item": "draft", "value": inputs.source},
                {"item": "format", "value": inputs.checkpoint.format},
                {"item": "trainer", "value": inputs.trainer.describe() if inputs.trainer else "not stated"},
                {"item": "knobs", "value": _knob_summary(cfg)},
                {"item": "inputs", "value": (f"{len(self.samples)} samples of "
                                             f"{inputs.data_file.name if inputs.data_file else 'seeded random ids'}, "
                                             f"<= {MAX_TOKENS} tokens each; aux states: {self.aux_source}")}]
        if inputs.target:
            t = inputs.target
            rows.append({"item": "target", "value": f"{t['model_type']}: {t['num_hidden_layers']} layers, hidden "
                                                    f"{t['hidden_size']}, vocab {t['vocab_size']}"})
        rows += [{"item": "note", "value": n} for n in inputs.notes]
        return rows

    def context(self) -> dict[str, str]:
        """What the verdict judged, in its own words (no temp paths)."""
        inputs = self.inputs
        self.aux()
        layers = inputs.target["num_hidden_layers"] if inputs.target else None
        served = ("this suite's conversion to SGLang's format, checked (every tensor, aux ids, norms, vocabulary); "
                  "the directory as written is problem 1" if self.converted else "the directory as written")
        return {"draft": f"{inputs.source}: {_knob_summary(inputs.config)}",
                "trainer": inputs.trainer.describe(layers) if inputs.trainer else "",
                "served_as": served,
                "inputs": (f"{len(self.samples)} samples of "
                           f"{inputs.data_file.name if inputs.data_file else 'seeded random ids'}; aux states: "
                           f"{self.aux_source}")}


def _knob_summary(cfg: Eagle3Config) -> str:
    on = [k for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "attention_bias",
                      "mlp_bias", "tie_word_embeddings") if getattr(cfg, k)]
    return (f"H {cfg.hidden_size}, Ht {cfg.target_hidden_size} x {cfg.num_aux_hidden_states} aux, "
            f"{cfg.num_hidden_layers} layer(s), {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x "
            f"{cfg.head_dim}, vocab {cfg.vocab_size} -> {cfg.draft_vocab_size}, rope "
            f"{(cfg.rope_scaling or {}).get('rope_type', 'default')} {cfg.rope_theta:g}"
            + (f", window {cfg.sliding_window}" if cfg.sliding_window else "")
            + (f"; on: {', '.join(on)}" if on else ""))


