"""SGLang's effective speculative settings: a server command line, requested vs effective.

The command line goes through SGLang's own parser (ServerArgs.add_cli_args, from_cli_args) and its
own resolution (resolve_once: the speculative hook included) on CPU, with the target's config and
the draft's; the effective values are SGLang's resolved_dict(), every field. The serving behaviours of
eagle3-semantics.md §5 that silently change what a trained draft does are listed next to them. draft_view
builds the draft as SGLang's EAGLE worker does under the resolved line and under SGLang's defaults, and
names each setting the build read that changes it, with the user's flag behind it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.core.areas import ASSERTED
from conformance.core.common import first_line
from conformance.core.registry import Known, applicable
from reference.eagle3 import Eagle3Config

# Settings the test runs with unless --sglang-args says otherwise: chain drafting with the steps the
# tiny draft was trained for (they conform: SGLang keeps them as they are).
DEFAULT_SGLANG_ARGS = ("--speculative-eagle-topk 1 "
                       "--speculative-num-steps 5 --speculative-num-draft-tokens 6")
# Prepended to every command line: where the models are, and what runs on a CPU host. The user's
# flags come after them, so theirs win.
HOST_ARGS = ("--speculative-algorithm", "EAGLE3", "--device", "cpu", "--attention-backend", "torch_native",
             "--skip-tokenizer-init")
# The chain's numbers: shown on every report, given or auto-chosen.
NUMBERS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
MISMATCH, NOTE = "mismatch", "note"


class CommandLineError(ValueError):
    """--sglang-args that SGLang's own parser or resolution refuses (one line)."""


@dataclass(frozen=True)
class Finding:
    setting: str
    requested: object          # as parsed from the command line (None: not given)
    effective: object          # what SGLang serves with
    verdict: str               # "mismatch": serving differs from what was asked for or trained; "note"
    why: str                   # the cause, with file:line in the pinned packages
    entry: str = ""            # the registry entry (conformance/core/registry.toml) it comes from, if any

    def line(self) -> str:
        return f"{self.setting}: requested {self.requested}, effective {self.effective}: {self.why}"


@dataclass
class DraftFacts:
    """What the checks need to know about the draft and the target besides the command line."""

    config: Eagle3Config             # the draft in training semantics (speculators format)
    trained_steps: int               # speculators_config.proposal_methods[0].speculative_tokens
    draft_embed: torch.Tensor        # the draft checkpoint's embed_tokens.weight
    target_embed: torch.Tensor       # the target's
    sglang_config: dict              # the draft config.json SGLang reads
    target_layers: int
    served: tuple[str, tuple[int, ...]] = ("", ())   # served_aux_layers: what SGLang read, layers_to_capture


@dataclass
class EffectiveSettings:
    command_line: str
    requested: dict
    effective: dict
    sglang_warnings: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def mismatches(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == MISMATCH]

    def rows(self) -> list[dict]:
        """Report rows: the chain's numbers and every setting the line gave (requested vs effective), then
        each finding."""
        rows = [{"command line": self.command_line, "setting": k, "requested": _show(self.requested.get(k)),
                 "effective": _show(self.effective.get(k)), "verdict": "", "why": ""} for k in shown(self)]
        by_setting = {r["setting"]: r for r in rows}
        for f in self.findings:
            row = by_setting.get(f.setting)
            if row is None or row["verdict"]:
                row = {"command line": self.command_line, "setting": f.setting, "requested": _show(f.requested),
                       "effective": _show(f.effective)}
                rows.append(row)
            row.update(verdict=f.verdict, why=f.why)
        return rows


def _show(value) -> str:
    return "(not given)" if value is None else str(value)


def shown(settings) -> list[str]:
    """The settings a report shows: the chain's numbers and every one the user's line gave."""
    return [k for k in settings.effective if k in NUMBERS or settings.requested.get(k) is not None]


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # argparse would print usage and exit; one line instead
        raise CommandLineError(f"--sglang-args: {message}")


@contextlib.contextmanager
def _sglang_warnings(out: list[str]):
    """Collect what SGLang warns while resolving (its own words for each adjustment).

    The calls are recorded on SGLang's module loggers themselves, not through handlers: whatever configured
    logging earlier in the process (SGLang's Engine, uvicorn's dictConfig, levels, disabled loggers) must
    not decide whether the words are seen."""
    import sglang.srt.arg_groups.speculative_hook  # noqa: F401  its logger speaks while resolving: exists from here on

    loggers = [lg for name, lg in list(logging.root.manager.loggerDict.items())
               if isinstance(lg, logging.Logger) and (name == "sglang" or name.startswith("sglang."))]

    def recording(original):
        def warning(msg, *args, **kwargs):
            out.append(str(msg) % args if args else str(msg))
            return original(msg, *args, **kwargs)
        return warning

    for lg in loggers:
        lg.warning = recording(lg.warning)
    try:
        yield
    finally:
        for lg in loggers:
            del lg.warning   # back to the class's method


@contextlib.contextmanager
def _environ_restored():
    """Resolution writes SGLang's switches into os.environ (serving_hook.py:435-446, e.g.
    SGLANG_ENABLE_TORCH_COMPILE); they are put back so that one resolution does not leak into the
    next or into the adapters of the same process."""
    before = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


@dataclass
class Resolution:
    """A server command line as SGLang resolves it for this target and draft."""

    command_line: str
    server_args: object              # SGLang's ServerArgs after resolve_once()
    parsed: argparse.Namespace       # the line as SGLang's parser reads it
    bare: argparse.Namespace         # the line without the user's flags (the host's only)
    requested: dict                  # every ServerArgs field: the value the user's flags gave it, None where none did
    effective: dict                  # every ServerArgs field as SGLang resolved it (its resolved_dict())
    warnings: list[str]              # what SGLang warned while resolving


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def flag(field: str) -> str:
    """The command-line flag of ServerArgs field `field`: its longest spelling in SGLang's parser."""
    spellings = [s for action in _parser()._actions if action.dest == field for s in action.option_strings]
    return max(spellings, key=len) if spellings else f"--{field.replace('_', '-')}"


def resolve_line(command_line: str, target_dir: Path, draft_dir: Path) -> Resolution:
    """The line through SGLang's own parser and ServerArgs.resolve_once() on CPU. The target and draft
    paths are given unless the line does; what the line gave is every field its flags moved off the
    value the line without them parses to."""
    from sglang.srt.server_args import ServerArgs

    try:
        user = shlex.split(command_line)
    except ValueError as exc:
        raise CommandLineError(f"--sglang-args: {exc}") from None
    host = ["--model-path", str(target_dir), "--speculative-draft-model-path", str(draft_dir), *HOST_ARGS]
    bare, parsed = _parser().parse_args(host), _parser().parse_args([*host, *user])
    requested = {k: v if v != getattr(bare, k) else None for k, v in vars(parsed).items()}
    server_args = ServerArgs.from_cli_args(parsed)
    warnings: list[str] = []
    with _sglang_warnings(warnings), _environ_restored():
        try:
            server_args.resolve_once()
        except Exception as exc:   # SGLang refuses the combination: its own words, one line
            first = first_line(exc)
            raise CommandLineError(f"--sglang-args: SGLang refuses {command_line!r}: {first}") from None
    return Resolution(command_line, server_args, parsed, bare, requested, server_args.resolved_dict(), warnings)


def resolve(command_line: str, target_dir: Path, draft_dir: Path):
    """(requested, effective, SGLang's warnings): resolve_line's."""
    line = resolve_line(command_line, target_dir, draft_dir)
    return line.requested, line.effective, line.warnings


# ---------------------------------------------------------------- the draft the flags build

@dataclass(frozen=True)
class DraftReading:
    """The draft as SGLang builds it under one set of settings, as the EAGLE worker does: the draft's
    TpModelWorker takes ModelConfig.from_server_args (managers/tp_worker.py _init_model_config), the model
    class SGLang picks for it, and its runner's KV cache dtype (model_runner.py configure_kv_cache_dtype)."""

    config: dict             # the draft's hf_config, nested keys joined: "rope_parameters.factor" -> 2.0
    stored: torch.dtype      # the dtype its config says the weights are (SGLang reads float32 where unset)
    dtype: torch.dtype       # the dtype SGLang computes in
    quantization: str | None
    kv_cache_dtype: torch.dtype
    module: dict             # the model SGLang builds from the config (meta device): "module.attribute" -> value


@dataclass(frozen=True)
class DraftChange:
    """One resolved setting that builds a different draft than the file's own reading."""

    setting: str                     # the ServerArgs field
    value: object                    # as resolved for the line
    default: object                  # as resolved without the user's flags
    flag: str                        # the user's flag that set it, or that SGLang derived it from ("" if none)
    read_at: tuple[str, str]         # (module, text of the line) where the draft's build reads the setting
    derived_by: tuple[str, str] | None   # (module, text of the line) where SGLang's resolution set it, if derived
    served: DraftReading             # the draft with this setting as resolved and every other as the file's


@dataclass(frozen=True)
class DraftView:
    file: DraftReading | None        # the draft under SGLang's defaults; None when SGLang cannot build it
    changes: list[DraftChange]
    context: int                     # the context the server runs (the target's ModelConfig)
    draft_context: int | None        # the draft's own (its ModelConfig without the target's)
    refused: str                     # SGLang's words when it refuses the draft at the server's context


class _View:
    """ServerArgs as the draft's build reads them: `overlay` over SGLang's resolving view of `base`,
    recording every field read. The overlay holds resolved values, so SGLang's pending declarations
    (_resolved_overrides) are read through `base` only."""

    def __init__(self, base, overlay: dict | None = None):
        from sglang.srt.arg_groups.model_override_base import resolving_view

        self._base, self._overlay = resolving_view(base), overlay or {}
        self.reads: dict[str, tuple[str, str]] = {}   # field -> where it was read: (module, text of the line)
        self.reader = ("", "{}")   # (module, text of its line, with {} for the field) of the code reading now

    def __getattr__(self, name: str):
        if name == "_resolved_overrides":
            return ()
        self.reads.setdefault(name, (self.reader[0], self.reader[1].format(name)))
        return self._overlay[name] if name in self._overlay else getattr(self._base, name)


_PLAIN = (int, float, str, bool, type(None), torch.dtype)


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _module(model_config) -> dict:
    """The draft model SGLang builds from this config, on the meta device and in one dtype (the dtype and
    the quantization are the reading's own fields): every module's class, plain attributes, parameter
    and buffer shapes. What the config changes here is what the draft computes differently."""
    from sglang.srt.model_loader.utils import get_model_architecture, set_default_torch_dtype

    from conformance.adapters.sglang.runtime import ensure_runtime

    ensure_runtime()
    cls, _ = get_model_architecture(model_config)
    with set_default_torch_dtype(torch.float32), torch.device("meta"):
        model = cls(copy.deepcopy(model_config.hf_config))   # the model writes into its config
    out = {}
    for name, module in model.named_modules():
        out[name or "(model)"] = type(module).__name__
        out.update({f"{name}.{k}": v for k, v in vars(module).items() if not k.startswith("_") and (
            isinstance(v, _PLAIN) or isinstance(v, (tuple, list)) and all(isinstance(e, _PLAIN) for e in v))})
        out.update({f"{name}.{k}": tuple(t.shape) for k, t in
                    [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]})
    return out


def _reading(view, context_length: int | None):
    """(DraftReading, ModelConfig) of the draft under `view`, as the EAGLE worker builds it."""
    from sglang.srt.configs.model_config import _STR_DTYPE_TO_TORCH_DTYPE, ModelConfig
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    view.reader = ("sglang.srt.configs.model_config", "cfg.{}")
    config = ModelConfig.from_server_args(view, model_path=view.speculative_draft_model_path,
                                          model_revision=view.speculative_draft_model_revision,
                                          is_draft_model=True, context_length=context_length)
    view.reader = ("sglang.srt.model_executor.model_runner", "def configure_kv_cache_dtype(")
    _, kv = configure_kv_cache_dtype(   # the draft runner's call (model_runner.py configure_kv_cache_dtype)
        server_args_kv_cache_dtype=view.kv_cache_dtype, model=None, model_dtype=config.dtype, is_draft_worker=True,
        is_dflash=False, speculative_draft_attention_backend=view.speculative_draft_attention_backend,
        speculative_draft_kv_cache_dtype=view.speculative_draft_kv_cache_dtype)
    stored = getattr(config.hf_config, "dtype", None)   # SGLang's reading of it: _get_and_verify_dtype
    stored = _STR_DTYPE_TO_TORCH_DTYPE.get(stored) if isinstance(stored, str) else stored
    return DraftReading(_flat(config.hf_config.to_dict()), stored or torch.float32, config.dtype,
                        config.quantization, kv, _module(config)), config


def _quiet_resolution(server_args):
    """resolve_once, its warnings and environment switches kept out of this process; None if SGLang refuses."""
    with _sglang_warnings([]), _environ_restored():
        try:
            server_args.resolve_once()
        except Exception:   # a line without one of the user's flags SGLang refuses: that flag decides nothing
            return None
    return server_args


def _deriving_flag(line: Resolution, setting: str) -> str:
    """The user's flag without which SGLang resolves `setting` to another value ("" if no single one)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import ServerArgs

    served = getattr(resolving_view(line.server_args), setting)
    for given in (k for k, v in line.requested.items() if v is not None and k != setting):
        without = copy.copy(line.parsed)
        setattr(without, given, getattr(line.bare, given))
        resolved = _quiet_resolution(ServerArgs.from_cli_args(without))
        if resolved is not None and getattr(resolving_view(resolved), setting) != served:
            return flag(given)
    return ""


def _declared_by(server_args, setting: str) -> tuple[str, str] | None:
    """(module, "setting=") of the line of SGLang's resolution that declared `setting` last, if one did: the
    step's label (the first element of each _resolved_overrides pair) names the arg_groups module it is in."""
    import importlib.util

    labels = [label for label, declared in getattr(server_args, "_resolved_overrides", None) or ()
              if setting in declared]
    if not labels:
        return None
    package = Path(importlib.util.find_spec("sglang.srt.arg_groups").origin).parent
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if f'"{labels[-1]}"' in text and f"{setting}=" in text:
            name = ".".join(path.relative_to(package.parent.parent.parent).with_suffix("").parts)
            return name, f"{setting}="
    return None


def draft_view(line: Resolution) -> DraftView:
    """The draft SGLang builds under the resolved line against the one its file describes (the line without
    the user's flags: SGLang's defaults), with the server's context. Each setting the draft's build read
    that the line moved is tried alone on the file's reading; those that change it are the changes, each
    with the user's flag behind it. The context is not part of the readings (each is built at the draft's
    own): the server's context is reported with SGLang's refusal, if any."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    context = ModelConfig.from_server_args(line.server_args).context_len   # the target's, as its worker builds it
    refused = ""
    try:   # the worker builds the draft at the target's context (speculative/eagle_worker_v2.py EagleDraftWorker)
        ModelConfig.from_server_args(line.server_args, model_path=line.effective["speculative_draft_model_path"],
                                     is_draft_model=True, context_length=context)
    except ValueError as exc:   # SGLang's own refusal, first sentence
        refused = str(exc).split(". ")[0]
    bare = ServerArgs.from_cli_args(line.bare)
    try:
        file, config = _reading(_View(bare), None)
    except Exception:   # the file itself: the loading and directory checks say why
        return DraftView(None, [], context, None, refused)
    served_view = _View(line.server_args)
    try:
        _reading(served_view, config.context_len)
    except Exception as exc:
        raise CommandLineError(f"--sglang-args: SGLang cannot build the draft with {line.command_line!r}: "
                               f"{first_line(exc)}") from None
    defaults = _View(bare)
    changes = []
    for setting, read_at in sorted(served_view.reads.items()):
        value = getattr(served_view, setting)
        if value == getattr(defaults, setting):
            continue
        try:
            served, _ = _reading(_View(bare, {setting: value}), config.context_len)
        except Exception as exc:
            raise CommandLineError(f"--sglang-args: SGLang cannot build the draft with {setting} {value!r}: "
                                   f"{first_line(exc)}") from None
        if served == file:
            continue
        given = line.requested.get(setting) is not None
        changes.append(DraftChange(setting, value, getattr(defaults, setting),
                                   flag(setting) if given else _deriving_flag(line, setting),
                                   read_at, None if given else _declared_by(line.server_args, setting),
                                   served))
    return DraftView(file, changes, context, config.context_len, refused)


def effective_settings(command_line: str, target_dir: Path, draft_dir: Path, facts: DraftFacts) -> EffectiveSettings:
    requested, effective, warnings = resolve(command_line, target_dir, draft_dir)
    out = EffectiveSettings(command_line, requested, effective, warnings)
    out.findings = findings(requested, effective, warnings, facts, target_architecture(target_dir))
    return out


def target_architecture(target_dir: Path) -> str:
    return json.loads((Path(target_dir) / "config.json").read_text())["architectures"][0]


def findings(requested: dict, effective: dict, warnings: list[str], facts: DraftFacts, arch: str) -> list[Finding]:
    """Each way the served draft differs from what was asked for or what it was trained on. What SGLang's
    resolution changed is observed; what SGLang does with a setting beyond that is the registry's
    `settings` entries for the installed version (conformance/core/registry.toml)."""
    out: list[Finding] = []
    known = applicable("settings", "sglang", settings_names(effective, facts))
    auto = all(requested[k] is None for k in NUMBERS)
    for k in NUMBERS:
        asked, got = requested[k], effective[k]
        if asked is None:
            out.append(Finding(k, None, got, NOTE,
                               f"auto-chosen by SGLang for a {arch} target (speculative_hook.py:1159-1174, 1430-1461)"
                               if auto else "derived by SGLang's resolution (speculative_hook.py)"))
        elif asked != got:   # observed; a registry entry on this setting says why
            entry = next((e for e in known if e.setting == k), None)
            said = next((w for w in warnings if k in w), "")
            why = (f"{entry.reason} [{entry.id}]" if entry else "changed by SGLang's resolution") + (
                f"; SGLang's warning: {said!r}" if said else "")
            out.append(Finding(k, asked, got, MISMATCH, why, entry.id if entry else ""))
    if (effective["speculative_eagle_topk"] or 1) > 1:
        topk = "speculative_eagle_topk"
        out.append(Finding(topk, requested[topk], effective[topk], NOTE,
                           "tree drafting (topk > 1): 1 + sum_k full_acc_k predicts chain drafting only"))
    steps = effective["speculative_num_steps"]
    if steps is not None and steps > facts.trained_steps:
        out.append(Finding("speculative_num_steps", requested["speculative_num_steps"], steps, MISMATCH,
                           f"drafts {steps} steps, but the draft was trained for {facts.trained_steps} TTT steps "
                           f"(speculators_config.proposal_methods[0].speculative_tokens): steps "
                           f"{facts.trained_steps + 1}..{steps} were never trained"))
    if effective["speculative_algorithm"] != "EAGLE3":
        algorithm = "speculative_algorithm"
        out.append(Finding(algorithm, requested[algorithm], effective[algorithm], MISMATCH,
                           "the draft is an EAGLE-3 draft (LlamaForCausalLMEagle3)"))
    out += [_registered(e, requested, effective, facts) for e in known if e.setting not in NUMBERS]
    for k in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        if effective.get(k) is not None and effective[k] < 1.0:   # a release without the flag: never relaxed
            out.append(Finding(k, requested[k], effective[k], NOTE,
                               "relaxed acceptance when sampling (arg_groups/fields/spec.py:109-116): accept length "
                               "above the greedy chain's"))
    if requested["max_running_requests"] is None:
        out.append(Finding("max_running_requests", None, effective["max_running_requests"], NOTE,
                           "set for speculative decoding (speculative_hook.py:1088-1097)"))
    out.append(_aux_layers(facts))
    out.append(Finding("verification", None, "greedy (argmax over the full target vocabulary)", NOTE,
                       "CPU hosts and all-greedy batches verify greedily (speculative/eagle_utils.py:485-500); "
                       "the simulated accept length uses the same rule"))
    return out


def settings_names(effective: dict, facts: DraftFacts) -> dict[str, object]:
    """What a registry settings condition reads: the effective settings and the draft's knobs."""
    return {**dataclasses.asdict(facts.config), **effective,
            "config_has_draft_vocab_size": facts.sglang_config.get("draft_vocab_size") is not None}


def _registered(entry: Known, requested: dict, effective: dict, facts: DraftFacts) -> Finding:
    """The finding a registry settings entry makes; embed_tokens is one only where the two embeddings differ."""
    why = f"{entry.reason} [{entry.id}{f', {ASSERTED}' if entry.asserted else ''}]"
    if entry.setting not in ("embed_tokens", "lm_head"):
        return Finding(entry.setting, requested.get(entry.setting), effective.get(entry.setting), MISMATCH, why,
                       entry.id)
    verdict = MISMATCH
    if entry.setting == "embed_tokens":
        draft, target = facts.draft_embed, facts.target_embed
        if draft.shape == target.shape and torch.equal(draft, target):
            verdict = NOTE
            why += ": no effect, they are identical (speculators trains with the target's frozen embedding)"
        else:
            why += (f": they differ (max abs {float((draft - target).abs().max()):.3e})" if draft.shape == target.shape
                    else ": they differ in shape")
    return Finding(entry.setting, "the draft's", "the target's", verdict, why, entry.id)


def _aux_layers(facts: DraftFacts) -> Finding:
    """Which target layers SGLang captures for this draft, against the training capture (input of layer i).
    SGLang's own path decides it (facts.served: its resolver and the target class's set_eagle3_layers_to_capture)."""
    read, served = facts.served
    n = facts.target_layers
    trained = tuple(facts.config.aux_layer_ids or (2, n // 2, n - 3))   # speculators' default (models/utils.py:109-117)
    how = f"SGLang read {read}; the target's layers_to_capture {list(served)} (input of layer i)"
    if any(not 0 <= b < n for b in served):   # the wiring checks (pytest -k wiring) show what each class does there
        return Finding("aux layers captured", trained, served, MISMATCH,
                       f"{how}: a boundary outside the inputs of layers 0..{n - 1}; trained on {trained}")
    return Finding("aux layers captured", trained, served, NOTE if trained == served else MISMATCH,
                   f"{how}; trained on {trained}")


def served_aux_layers(target_dir: Path, draft_dir: Path) -> tuple[str, tuple[int, ...]]:
    """(what SGLang read from the draft config, the target's layers_to_capture), through SGLang's own path as
    the wiring checks take it: resolve_spec_aux_hidden_state_config, then the target class's
    set_eagle3_layers_to_capture; the class is SGLang's own pick for the target's config
    (model_loader/utils.py get_model_architecture), built without weights."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    from conformance.adapters.sglang.target import build_target, sglang_aux_layer_ids
    from fixtures.targets import TargetSpec

    aux = sglang_aux_layer_ids(Path(draft_dir), Path(draft_dir).parent)   # also sets up SGLang's runtime
    cls, arch = get_model_architecture(ModelConfig(str(target_dir), dtype="float32"))
    target = build_target(TargetSpec(arch, f"{cls.__module__}:{cls.__name__}", "", "", "mha"), Path(target_dir))
    target.set_capture(aux)
    read = "no eagle_config ids" if aux.layer_ids is None else f"eagle_config ids {list(aux.layer_ids)}"
    return (read if aux.use_aux else "use_aux_hidden_state false"), tuple(target.layers_to_capture)


def draft_facts(speculators_dir: Path, sglang_dir: Path, target_dir: Path, config: Eagle3Config) -> DraftFacts:
    from conformance.checkpoints import WEIGHTS_FILE

    raw = json.loads((Path(speculators_dir) / "config.json").read_text())
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    with safe_open(str(Path(sglang_dir) / WEIGHTS_FILE), framework="pt") as f:
        draft_embed = f.get_tensor("embed_tokens.weight")
    target_embed = None
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight"):
                    target_embed = f.get_tensor(name)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    return DraftFacts(config=config, trained_steps=int(methods[0].get("speculative_tokens", 3)),
                      draft_embed=draft_embed, target_embed=target_embed,
                      sglang_config=json.loads((Path(sglang_dir) / "config.json").read_text()),
                      target_layers=target["num_hidden_layers"], served=served_aux_layers(target_dir, sglang_dir))
