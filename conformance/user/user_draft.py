"""Bring your own draft: the user's checkpoint, training data and target config, checked up front and
run through the same conformance path (DraftStore, assert_conforms, accounting) as the tiny cases.

Validation raises one-line CheckpointErrors naming the file and the field (conftest turns them into
pytest.UsageError: exit code 4). The user's files are only ever read: each implementation gets a copy
converted to its own format in a temp directory. Without --draft-checkpoint the same path runs on a
fixture draft written as SpecForge exports it (midlayer names, no embed_tokens), with a JSONL sample
and a hidden-state dump from a tiny target.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conformance.core.harness import DraftStore
from fixtures.cases import DraftCase
from fixtures.checkpoint import WEIGHTS_FILE, sha256
from conformance.checkpoints.formats import (CONFIG_FILE, INDEX_FILE, CheckpointError, DraftCheckpoint, expected_tensors, from_canonical,
                              open_checkpoint, read_target_config, read_tensor, read_weights, undeclared_tensors,
                              write_draft)
from conformance.user.example_draft import EXAMPLE_CONFIG, write_example
from conformance.checkpoints.training_data import (MAX_TOKENS, Sample, TinyTarget, first_samples, load_samples, make_data_batch,
                                    make_samples, read_dump, uses_tiny_target)
from reference.eagle3 import Eagle3Config

USER_CASE_ID = "user_draft"
SGLANG_FAMILY = ("sglang", "sglang-legacy", "specforge")   # formats SGLang loads as they are
SEED = 0                                    # weights substituted for a missing embed_tokens, random inputs
RANDOM_LENGTHS = (9, 5, 12)                 # token counts when no training data is given
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class UserInputs:
    checkpoint: DraftCheckpoint
    config: Eagle3Config
    source: str                                       # what ran, for the report (no temp paths)
    samples: list[Sample] | None = None
    data_file: Path | None = None
    hidden_states: Path | None = None
    target: dict | None = None
    notes: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)   # every input file -> sha256, to prove it untouched


# ---------------------------------------------------------------- validation

def _needed_by(name: str, cfg: Eagle3Config) -> str:
    if name == "input_norm.weight":
        return "norm_before_fc is true"
    if name.startswith("fc_norm."):
        return "fc_norm is true"
    if name.endswith(".bias"):
        return "attention_bias is true" if "self_attn" in name else "mlp_bias is true"
    if name == "lm_head.weight":
        return "tie_word_embeddings is false"
    if name in ("d2t", "t2d"):
        return f"draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size}"
    return "every EAGLE-3 draft"


def validate_checkpoint(path: Path) -> tuple[DraftCheckpoint, list[str]]:
    """Config, tensor names, shapes, dtypes, finiteness and the vocab map; the first problem raises."""
    from conformance.loading.accounting import vocab_map_problems

    ckpt = open_checkpoint(Path(path))
    cfg = ckpt.config                     # unsupported or contradictory knobs raise here
    notes = list(ckpt.parsed.notes)
    expected, optional = expected_tensors(cfg), undeclared_tensors(cfg)
    weights_file = next(iter(ckpt.tensors.values())).file if ckpt.tensors else Path(path)
    for name, (shape, kind) in expected.items():
        if name in ckpt.tensors:
            continue
        if name == "embed_tokens.weight":
            notes.append("embed_tokens absent (as SpecForge and EAGLE-3 export): SGLang serves with the target's; "
                         "this run substitutes a seeded random one for every implementation")
            continue
        raise CheckpointError(weights_file, f"tensor {from_canonical(name, ckpt.format)}",
                              f"missing (needed because {_needed_by(name, cfg)})")
    for name, info in ckpt.tensors.items():
        where = (info.file, f"tensor {info.stored_name}")
        if name not in expected and name not in optional:
            raise CheckpointError(*where, "extra tensor: not part of an EAGLE-3 draft with this config.json")
        shape, kind = expected.get(name) or optional[name]
        if info.shape != shape:
            raise CheckpointError(*where, f"shape {info.shape}, expected {shape} from {CONFIG_FILE}")
        if kind == "float" and info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(*where, f"dtype {_dtype(info.dtype)}, expected a float dtype (fp32, bf16, fp16)")
        if kind == "int64" and info.dtype != torch.int64:
            raise CheckpointError(*where, f"dtype {_dtype(info.dtype)}, expected int64 (offsets, speculators model.py:51-55)")
        if kind == "bool" and info.dtype != torch.bool:
            raise CheckpointError(*where, f"dtype {_dtype(info.dtype)}, expected bool (speculators model.py:51-55)")
        if name not in expected:
            notes.append(f"{info.stored_name}: not declared by {CONFIG_FILE}; implementations treat it differently "
                         "(see weight accounting)")
    vocab = {}
    for name, info in ckpt.tensors.items():
        tensor = read_tensor(info)
        if tensor.is_floating_point():
            bad = (~torch.isfinite(tensor)).nonzero()
            if bad.numel():
                index = tuple(int(i) for i in bad[0])
                raise CheckpointError(info.file, f"tensor {info.stored_name}",
                                      f"{tensor[index].item()} at index {index} (NaN/inf weights)")
        if name in ("d2t", "t2d"):
            vocab[name] = tensor
    for name, problem in vocab_map_problems(vocab, cfg.vocab_size, cfg.draft_vocab_size):
        info = ckpt.tensors.get(name)
        raise CheckpointError(info.file if info else weights_file,
                              f"tensor {info.stored_name if info else name}", problem)
    return ckpt, notes


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def input_files(*paths: Path | None) -> list[Path]:
    out = []
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        out += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else ([p] if p.is_file() else [])
    return out


def validate_inputs(checkpoint: Path, data: Path | None = None, hidden_states: Path | None = None,
                    target: Path | None = None, source: str | None = None) -> UserInputs:
    """Every user input, validated; the first problem raises a one-line CheckpointError."""
    ckpt, notes = validate_checkpoint(Path(checkpoint))
    cfg = ckpt.config
    inputs = UserInputs(ckpt, cfg, source or f"--draft-checkpoint {Path(checkpoint).name} ({ckpt.format} format)",
                        notes=notes)
    if data is not None:
        inputs.data_file = Path(data)
        inputs.samples = load_samples(Path(data), cfg.vocab_size)
    if hidden_states is not None:
        if inputs.samples is None:
            raise CheckpointError(hidden_states, "option --hidden-states", "needs --training-data (the dump's token ids)")
        inputs.hidden_states = Path(hidden_states)
        read_dump(Path(hidden_states), inputs.samples[:len(first_samples(inputs.samples))], cfg)
    if target is not None:
        inputs.target = read_target_config(Path(target))
    # The files this run reads (not whatever else lives in the user's directories).
    read = [ckpt.path / CONFIG_FILE, *dict.fromkeys(i.file for i in ckpt.tensors.values())]
    read += [ckpt.path / INDEX_FILE] if (ckpt.path / INDEX_FILE).is_file() else []
    if inputs.hidden_states is not None:
        read += [inputs.hidden_states / f"hs_{i}.safetensors" for i in range(len(first_samples(inputs.samples)))]
    inputs.digests = {str(p): sha256(p) for p in read + input_files(data, target)}
    return inputs


# ---------------------------------------------------------------- the user's case

def user_case(cfg: Eagle3Config, lengths: tuple[int, ...], summary: str) -> DraftCase:
    """The user's draft as a DraftCase: every knob spelled out, so known divergences match as for any case."""
    overrides = tuple((f.name, getattr(cfg, f.name)) for f in fields(Eagle3Config))
    return DraftCase(USER_CASE_ID, overrides, lengths, seed=SEED, summary=summary)


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

    def is_user(self, case: DraftCase) -> bool:
        """The user's case, or a relabelled copy of it (e.g. the multi-step run's)."""
        return case.id.startswith(USER_CASE_ID) and case.overrides == self.case.overrides

    def checkpoint(self, case: DraftCase) -> dict[str, Path]:
        """Copies in each implementation's format. SGLang-family drafts keep their own config.json and
        tensor names, so SGLang reads them exactly as it would serve them (its legacy names, its
        reading of norm_output, ...); other formats go through this suite's converter (conformance/checkpoints/formats.py)."""
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
                stored = {src.tensors[k].stored_name if k in src.tensors else k: v.contiguous() for k, v in weights.items()}
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
                self.aux_source = f"tiny random target (layers {list(target.aux_layer_ids)} of {target.model.config.num_hidden_layers})"
            else:
                g = torch.Generator().manual_seed(SEED + 3)
                self._aux = [torch.randn(len(s.input_ids) - 1, A * Ht, generator=g, dtype=torch.float64) for s in samples]
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
            self._accounts = {impl: account(impl, dirs[fmt], torch.float32, self.inputs.target)
                              for impl, fmt in (("reference", "speculators"), ("speculators", "speculators"),
                                                ("sglang", "sglang"))}
        return self._accounts

    def report_rows(self) -> list[dict]:
        """What ran, for the report's "bring your own draft" section (no temp paths)."""
        inputs, cfg = self.inputs, self.inputs.config
        self.aux()
        rows = [{"item": "draft", "value": inputs.source},
                {"item": "format", "value": inputs.checkpoint.format},
                {"item": "knobs", "value": _knob_summary(cfg)},
                {"item": "inputs", "value": (f"{len(self.samples)} samples of "
                                             f"{inputs.data_file.name if inputs.data_file else 'seeded random ids'}, "
                                             f"<= {MAX_TOKENS} tokens each; aux states: {self.aux_source}")}]
        if inputs.target:
            t = inputs.target
            rows.append({"item": "target", "value": f"{t['model_type']}: {t['num_hidden_layers']} layers, hidden "
                                                    f"{t['hidden_size']}, vocab {t['vocab_size']}"})
        rows += [{"item": "note", "value": n} for n in inputs.notes]
        try:   # SGLang's own path routing, applied to the user's directory name
            from sglang.srt.utils.hf_transformers.mistral_utils import is_mistral_model
            if is_mistral_model(inputs.checkpoint.path.resolve()):
                rows.append({"item": "note", "value": "SGLang routes this directory to its Mistral params.json parser "
                                                      "(mistral_utils.py:361-362: 'eagle' and 'mistral' in the path); "
                                                      "rename it before serving"})
        except ImportError:
            pass
        return rows


def _knob_summary(cfg: Eagle3Config) -> str:
    on = [k for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "attention_bias",
                      "mlp_bias", "tie_word_embeddings") if getattr(cfg, k)]
    return (f"H {cfg.hidden_size}, Ht {cfg.target_hidden_size} x {cfg.num_aux_hidden_states} aux, "
            f"{cfg.num_hidden_layers} layer(s), {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x "
            f"{cfg.head_dim}, vocab {cfg.vocab_size} -> {cfg.draft_vocab_size}, rope "
            f"{(cfg.rope_scaling or {}).get('rope_type', 'default')} {cfg.rope_theta:g}"
            + (f", window {cfg.sliding_window}" if cfg.sliding_window else "")
            + (f"; on: {', '.join(on)}" if on else ""))


# ---------------------------------------------------------------- pytest wiring (called from conftest.py)

INPUTS_KEY = pytest.StashKey[UserInputs]()
TARGET_KEY = pytest.StashKey[dict]()


def configure_user_inputs(config) -> None:
    """Validate --draft-checkpoint, --training-data, --hidden-states, --target-config; stash the result."""
    ckpt, data = config.getoption("--draft-checkpoint"), config.getoption("--training-data")
    hidden, target = config.getoption("--hidden-states"), config.getoption("--target-config")
    if (data or hidden) and not ckpt:
        raise pytest.UsageError(f"{'--training-data' if data else '--hidden-states'} needs --draft-checkpoint "
                                "(the samples are inputs of that draft)")
    try:
        if target:
            config.stash[TARGET_KEY] = read_target_config(Path(target))
        if ckpt:
            inputs = validate_inputs(Path(ckpt), Path(data) if data else None, Path(hidden) if hidden else None,
                                     Path(target) if target else None)
            config.stash[INPUTS_KEY] = inputs
    except CheckpointError as exc:
        raise pytest.UsageError(str(exc)) from None


def collection_case(config) -> DraftCase:
    """The user case as known at collection (its knobs decide the known-divergence marks)."""
    inputs = config.stash.get(INPUTS_KEY, None)
    cfg = inputs.config if inputs is not None else EXAMPLE_CONFIG
    return user_case(cfg, (), "")


def make_user_store(config, root: Path) -> UserDraftStore:
    inputs = config.stash.get(INPUTS_KEY, None)
    if inputs is None:
        ckpt, data, dump = write_example(root / "inputs", "specforge")
        inputs = validate_inputs(ckpt, data, dump, source="fixture: tiny SpecForge-shaped export without "
                                                              "embed_tokens, JSONL samples, tiny-target dump")
    return UserDraftStore(root / "store", inputs)
