"""The user's draft as a DraftStore case: the same conformance path (traces, compare, accounting) as the
tiny cases, on copies of the user's files in each implementation's format.

One reading per file: every implementation loads the directory as the user wrote it (config.json copied as
written, the weights linked) in each format it reads: SGLang the SGLang family (SGLang's format, its legacy
names, SpecForge's export), speculators and vLLM the speculators format, vLLM also SGLang's. Only an
implementation that cannot read the format at all gets this suite's conversion, which keeps the keys the file
states that training overrules (knobs.py ParsedConfig.overruled), and the verdict's "served as" line says so
(for SGLang its first problem too, conformance/user/servable.py). Where two implementations read the file
differently, the verdict names each reading (conformance/user/readings.py). What runs, and what is reduced
for a large draft, is the Plan's (conformance/user/plan.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conformance.adapters import ADAPTERS, DEFAULT_SERVER
from conformance.core.trace import Trace
from conformance.checkpoints.directory import write_draft
from conformance.checkpoints.errors import ConversionError
from conformance.checkpoints.hidden_states import TinyTarget, read_dump, uses_tiny_target
from conformance.checkpoints.knobs import CONFIG_FILE
from conformance.checkpoints.training_data import MAX_TOKENS, Sample, first_samples, make_data_batch, make_samples
from conformance.checkpoints.weights import WEIGHTS_FILE, read_weights
from conformance.session.harness import DraftStore
from conformance.user import mla
from conformance.user.plan import STEPS, plan_for
from conformance.user.servable import served_ids, write_served_ids
from conformance.user.serving import STAND_IN
from conformance.user.trainer import TRAINED_OPTION, layer_names, other_trainers, possible_trainers
from conformance.user.example_draft import write_example
from conformance.user.user_draft import (FIXTURE_FORMAT, INPUTS_KEY, SEED, USER_CASE_ID, UserInputs, user_case,
                                        validate_inputs)
from fixtures.cases import DraftCase
from reference.eagle3 import Eagle3Config

# Formats SGLang loads as they are (sglang-mla: its MLA draft's, conformance/user/mla.py)
SGLANG_FAMILY = ("sglang", "sglang-legacy", "specforge", "nemo-sglang", "sglang-mla")
# A format another trainer's own loader also reads as written: NeMo's directory renamed for SGLang by NeMo's
# serve_sglang is still NeMo's checkpoint (its loader ignores architectures, checkpoints/formats/nemo_sglang.py).
ALSO_READ_AS = {"nemo-sglang": "nemo"}
RANDOM_LENGTHS = (9, 5, 12)                 # token counts when no training data is given
# SGLang modules whose import fails on a CPU host (no deep_ep, no torch_memory_saver) and which keep the
# ImportError in a module global: imported first from here, the failing import's frames hold nothing; left
# to the first model build and forward, those frames hold that model for the rest of the process.
SGLANG_LAZY_IMPORTS = ("sglang.srt.utils.torch_memory_saver_adapter", "sglang.srt.model_executor.runner")


def sglang_reads_as_written(fmt: str, cfg: Eagle3Config) -> bool:
    """Whether SGLang serves a directory in `fmt` as written: a format of its family, and for an MLA draft only the
    format of its MLA class (the others name its Llama draft's class: NeMo's serve_sglang writes
    LlamaForCausalLMEagle3 for every draft, speculative/serve_sglang.py:93-95, which builds a Llama layer and
    drops the MLA attention's tensors, conformance/draft/test_nemo_served.py)."""
    server = ADAPTERS[DEFAULT_SERVER]
    own_format = server().format_for(cfg)
    return fmt in SGLANG_FAMILY and (own_format == server.checkpoint_format or fmt == own_format)


def used_samples(inputs: UserInputs) -> list[Sample]:
    if inputs.samples is not None:
        return first_samples(inputs.samples)
    ids = make_samples(inputs.config, tuple(n + 1 for n in RANDOM_LENGTHS), torch.Generator().manual_seed(SEED + 1))
    return [Sample(0, tuple(s), (0,) * len(s), len(s), "seeded random") for s in ids]


class UserDraftStore(DraftStore):
    """A DraftStore whose `user_draft` case is the user's checkpoint and inputs (other cases as usual)."""

    def __init__(self, root: Path, inputs: UserInputs, servers: tuple[str, ...] = ("sglang",)):
        super().__init__(root)
        self.inputs = inputs
        self.servers = servers                # the servers the verdict judges (--serve-with)
        self.written_formats: set[str] = set()   # the formats whose directory is the user's, as written
        self.samples = used_samples(inputs)
        self.aux_source = ""
        self._aux: list[torch.Tensor] | None = None
        self._accounts: dict | None = None
        self.reported = False
        self.case = user_case(inputs.config, tuple(len(s.input_ids) - 1 for s in self.samples), inputs.source)
        self.plan = plan_for(inputs.checkpoint.tensors)
        self.eagle_ids: tuple[tuple[int, ...] | None, str] = (None, "")   # what the conversion wrote, and why
        self._serving: dict = {}
        for module in SGLANG_LAZY_IMPORTS:
            importlib.import_module(module)

    @property
    def converted(self) -> bool:
        """Whether SGLang gets this suite's conversion instead of the directory as written."""
        return not sglang_reads_as_written(self.inputs.checkpoint.format, self.inputs.config)

    def weights(self) -> dict[str, torch.Tensor]:
        """The user's tensors as the implementations get them (_weights)."""
        return _weights(self.inputs.checkpoint.path, self.inputs.config)

    def is_user(self, case: DraftCase) -> bool:
        """The user's case, or a relabelled copy of it (e.g. the multi-step run's)."""
        return case.id.startswith(USER_CASE_ID) and case.overrides == self.case.overrides

    def checkpoint(self, case: DraftCase) -> dict[str, Path]:
        """A directory per format: the user's, as written, in its own format (and, for the SGLang family, as
        SGLang's: SGLang reads those as written, its legacy names and its reading of norm_output included);
        this suite's conversion in the others (conformance/checkpoints/directory.py)."""
        if not self.is_user(case):
            return super().checkpoint(case)
        case = self.case
        if case.id not in self._checkpoints:
            src, cfg = self.inputs.checkpoint, self.inputs.config
            root = self.root / case.id
            loaded: dict[str, torch.Tensor] = {}

            def weights() -> dict[str, torch.Tensor]:
                if not loaded:
                    loaded.update(_weights(src.path, cfg))
                return loaded

            def converted(fmt: str, out: Path) -> Path:
                write_draft(cfg, weights(), out, fmt)
                _keep_stated(out, fmt, src.parsed.overruled)
                return out

            dirs = {}
            for fmt in ("speculators", "sglang"):
                if src.format == fmt or (fmt == "sglang" and sglang_reads_as_written(src.format, cfg)):
                    dirs[fmt] = _as_written(src, root / fmt, weights)
                    self.written_formats.add(fmt)
                elif fmt == "sglang":   # the format SGLang serves the draft from (an MLA draft's: sglang-mla)
                    dirs[fmt] = converted(ADAPTERS[DEFAULT_SERVER]().format_for(cfg), root / fmt)
                else:
                    dirs[fmt] = converted(fmt, root / fmt)
            if "sglang" not in self.written_formats:
                self.eagle_ids = served_ids(self.inputs.trainer, self.inputs.target_file, self.root / "twins")
                write_served_ids(dirs["sglang"], self.eagle_ids[0])
            # A trainer with a format of its own (SpecForge's, NeMo's) reads its own directory as written (its
            # names, its readings); any other format as this suite writes its format, when that format can
            # express the draft (else its adapter skips). Only for a draft that trainer trained: no other runs
            # it (trainer.other_trainers).
            run_formats = {a.checkpoint_format for impl, a in ADAPTERS.items()
                           if impl not in other_trainers(self.inputs.trainer)}
            for fmt in sorted(run_formats - set(dirs)):
                if fmt in (src.format, ALSO_READ_AS.get(src.format)):
                    dirs[fmt] = _as_written(src, root / fmt, weights)
                    self.written_formats.add(fmt)
                else:
                    with contextlib.suppress(ConversionError):
                        dirs[fmt] = converted(fmt, root / fmt)
            self._checkpoints[case.id] = dirs
        return self._checkpoints[case.id]

    def read_format(self, impl: str) -> str:
        """The format of the directory `impl` loads the user's draft from: the user's own where `impl` reads it
        (its adapter's format or one of its `other_formats`), else its adapter's (a conversion)."""
        adapter, fmt = ADAPTERS[impl], self.inputs.checkpoint.format
        own = "sglang" if fmt in SGLANG_FAMILY and adapter.checkpoint_format == "sglang" else \
            ALSO_READ_AS.get(fmt, fmt) if adapter.checkpoint_format == ALSO_READ_AS.get(fmt) else fmt
        return own if own in (adapter.checkpoint_format, *getattr(adapter, "other_formats", ())) \
            else adapter.checkpoint_format

    def directory(self, impl: str, case: DraftCase) -> Path:
        if not self.is_user(case):
            return super().directory(impl, case)
        return self.checkpoint(case)[self.read_format(impl)]

    def as_written(self, impl: str) -> bool:
        """Whether `impl` loads the user's directory as written (else this suite's conversion)."""
        self.checkpoint(self.case)
        return self.read_format(impl) in self.written_formats

    def trace(self, impl: str, case: DraftCase, dtype: torch.dtype, steps: int = 1,
              teacher_forced: bool = True) -> Trace:
        """The user's case under one key whatever it is labelled (the multi-step check relabels it); with
        the plan's step0_from_steps, step 0 is read off the STEPS-step run. Each model is freed before the
        next one loads (SGLang's holds reference cycles: gc.collect frees it, refcounts do not)."""
        if not self.is_user(case):
            return super().trace(impl, case, dtype, steps, teacher_forced)
        if self.plan.step0_from_steps and steps == 1 and teacher_forced:
            full = self.trace(impl, case, dtype, STEPS)
            return dataclasses.replace(full, steps=full.steps[:1], rows=full.rows[:1])
        key = (impl, self.case.id, dtype, steps, teacher_forced)
        fresh = key not in self._traces
        try:
            return super().trace(impl, self.case, dtype, steps, teacher_forced)
        finally:
            if fresh and ADAPTERS[impl].is_server:   # a serving engine's model: free it before the next
                gc.collect()

    @property
    def precise(self) -> torch.dtype:
        """The reference the error model takes as exact: fp64, or fp32 for a large draft (the plan's)."""
        return self.plan.precise

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
        from conformance.adapters import account

        if self._accounts is None:
            dirs = self.checkpoint(self.case)
            self._accounts = {}
            for impl, adapter in ADAPTERS.items():
                if adapter.lane != "cpu":   # its own lane (vLLM's environment): only when asked (account_of)
                    continue
                if impl in other_trainers(self.inputs.trainer) or adapter.checkpoint_format not in dirs:
                    continue   # another trainer's implementation, or one that cannot express the draft
                if impl == mla.IMPL and mla.is_mla(self.inputs):   # its MLA class, not the Llama draft's
                    self._accounts[impl] = mla.account(self)
                else:
                    self._accounts[impl] = account(impl, self.directory(impl, self.case), self.plan.accounting,
                                                   self.inputs.target)
                gc.collect()   # the model it loaded, before the next one loads
        return self._accounts

    def account_of(self, impl: str):
        """One implementation's accounting of the user's draft: the default lane's from accounts(), a server of a
        lane of its own (vLLM, with --serve-with) computed on first ask."""
        from conformance.adapters import account

        accounts = self.accounts()
        if impl not in accounts:
            accounts[impl] = account(impl, self.directory(impl, self.case), self.plan.accounting,
                                     self.inputs.target)
        return accounts[impl]

    def serving(self, name: str, compute):
        """A serving check's result (wiring, settings), computed once: several user checks read it."""
        if name not in self._serving:
            self._serving[name] = compute()
        return self._serving[name]

    def report_rows(self) -> list[dict]:
        """What ran, for the report's "bring your own draft" section (no temp paths)."""
        inputs, cfg = self.inputs, self.inputs.config
        self.aux()
        rows = [{"item": "draft", "value": inputs.source},
                {"item": "format", "value": inputs.checkpoint.format},
                {"item": "trainer", "value": self.trainer_line() or "not stated"},
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

    def trainer_line(self, layers: int | None = None) -> str:
        """Who trained the draft and what its ids mean; when nobody is named, which trainers could have."""
        trainer = self.inputs.trainer
        if trainer is None:
            return ""
        line = trainer.describe(layers)
        return line if trainer.name is not None else f"{line}; {possible_trainers(self.inputs.config)}"

    def convert_args(self) -> str:
        """The converter's options that reproduce this run's conversion (the user's file names only)."""
        inputs, out = self.inputs, []
        if inputs.target_file is not None:
            out.append(f"--target-config {inputs.target_file.name}")
        if inputs.trainer is not None and inputs.trainer.stated_ids is not None:
            out.append(f"{TRAINED_OPTION} {layer_names(inputs.trainer.stated_ids)[1:-1].replace(' ', '')}")
        return " ".join(out)

    def context(self) -> dict[str, str]:
        """What the verdict judged, in its own words (no temp paths)."""
        inputs = self.inputs
        self.aux()
        self.checkpoint(self.case)   # the conversion's ids, for `served_as`
        layers = inputs.target["num_hidden_layers"] if inputs.target else None
        served = ("this suite's conversion to SGLang's format, checked (every tensor, aux ids, norms, vocabulary); "
                  "the directory as written is problem 1" if self.converted else "the directory as written")
        ids, why = self.eagle_ids
        if self.converted and why:
            served += f"; eagle_config ids {list(ids) if ids else 'none'} ({why})"
        for impl in (s for s in self.servers if s != DEFAULT_SERVER):
            served += f"; {impl}: " + ("the directory as written" if self.as_written(impl) else
                                       f"this suite's conversion to the {self.read_format(impl)} format ({impl} "
                                       f"does not read the {inputs.checkpoint.format} format)")
        return {"draft": f"{inputs.source}: {_knob_summary(inputs.config)}",
                "trainer": self.trainer_line(layers),
                "served_as": served,
                "inputs": (f"{len(self.samples)} samples of "
                           f"{inputs.data_file.name if inputs.data_file else 'seeded random ids'}; aux states: "
                           f"{self.aux_source}" + (f"; {self.plan.reduced}" if self.plan.reduced else "")
                           + (f"; {STAND_IN}" if inputs.sglang_args is not None and inputs.target_file is None
                              else ""))}


def _weights(path: Path, cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (memory-mapped by safetensors); a missing embed_tokens is substituted by a
    seeded random one, as every implementation then gets it."""
    weights = read_weights(path)
    if "embed_tokens.weight" not in weights:
        dtype = weights["fc.weight"].dtype
        weights["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(SEED)).to(dtype)
    return weights


def _linkable(src) -> bool:
    """One safetensors file, written by torch (metadata format pt, which transformers' loader asks for),
    with embed_tokens: an implementation can read it where it lies."""
    files = {i.file for i in src.tensors.values()}
    if len(files) != 1 or next(iter(files)).name != WEIGHTS_FILE or "embed_tokens.weight" not in src.tensors:
        return False
    with safe_open(str(next(iter(files))), framework="pt") as f:
        return (f.metadata() or {}).get("format") == "pt"


def _as_written(src, out: Path, weights) -> Path:
    """`out` holding the source directory as written: its config.json copied, its weights linked (never written
    through) where an implementation can read them where they lie, else saved under their stored names
    (`weights()`: canonical names, a missing embed_tokens substituted)."""
    out.mkdir(parents=True, exist_ok=True)
    if _linkable(src):
        (out / WEIGHTS_FILE).symlink_to((src.path / WEIGHTS_FILE).resolve())
    else:
        stored = {src.tensors[k].stored_name if k in src.tensors else k: v.contiguous() for k, v in weights().items()}
        save_file(stored, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    shutil.copyfile(src.path / CONFIG_FILE, out / CONFIG_FILE)
    return out


def _keep_stated(out: Path, fmt: str, stated: dict[str, object]) -> None:
    """A conversion's config.json with the keys the user's file states that training overrules, as stated (the
    conversion writes training's reading): each implementation then reads the flag the file gives it."""
    if not stated:
        return
    config = json.loads((out / CONFIG_FILE).read_text())
    config.update(stated)
    if fmt == "speculators":   # its loader reads the decoder layer's own config too
        config["transformer_layer_config"].update(stated)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _knob_summary(cfg: Eagle3Config) -> str:
    on = [k for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "attention_bias",
                      "mlp_bias", "tie_word_embeddings") if getattr(cfg, k)]
    return (f"H {cfg.hidden_size}, Ht {cfg.target_hidden_size} x {cfg.num_aux_hidden_states} aux, "
            f"{cfg.num_hidden_layers} layer(s), {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x "
            f"{cfg.head_dim}, vocab {cfg.vocab_size} -> {cfg.draft_vocab_size}, rope "
            f"{(cfg.rope_scaling or {}).get('rope_type', 'default')} {cfg.rope_theta:g}"
            + (f", window {cfg.sliding_window}" if cfg.sliding_window else "")
            + (f"; on: {', '.join(on)}" if on else ""))


def make_user_store(config, root: Path):
    """A UserDraftStore on --draft-checkpoint, or, without it, on a fixture draft."""
    inputs = config.stash.get(INPUTS_KEY, None)
    if inputs is None:
        ckpt, data, dump = write_example(root / "inputs", FIXTURE_FORMAT)
        inputs = validate_inputs(ckpt, data, dump, source="fixture: tiny SpecForge-shaped export without "
                                                              "embed_tokens, JSONL samples, tiny-target dump")
    from conformance.user.serving import served_with

    store = UserDraftStore(root / "store", inputs, tuple(served_with(config)))
    # The imports (torch, transformers, sglang, the trainers) are done and live as long as the process: frozen,
    # the collection that frees each server's model (trace, accounts) walks only what the models made; unfrozen,
    # each walked every imported object, 0.5 s a collection on a tiny draft.
    gc.freeze()
    return store
