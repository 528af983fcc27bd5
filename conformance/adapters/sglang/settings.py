"""SGLang's effective speculative settings: a server command line, requested vs effective.

The command line goes through SGLang's own parser (ServerArgs.add_cli_args, from_cli_args) and its
own resolution (resolve_once: the speculative hook included) on CPU, with the target's config and
the draft's; the effective values are SGLang's resolved_dict(). The serving behaviours of
eagle3-semantics.md §5 that silently change what a trained draft does are listed next to them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.adapters.sglang import compat
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
NUMBERS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
SHOWN = NUMBERS + ("speculative_algorithm", "speculative_token_map", "speculative_draft_window_size",
                   "speculative_draft_sink_size", "speculative_use_rejection_sampling",
                   "speculative_accept_threshold_single", "speculative_accept_threshold_acc",
                   "max_running_requests")
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
        """Report rows: every shown setting (requested vs effective), then each finding."""
        rows = [{"command line": self.command_line, "setting": k, "requested": _show(self.requested.get(k)),
                 "effective": _show(self.effective.get(k)), "verdict": "", "why": ""} for k in SHOWN]
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


def resolve(command_line: str, target_dir: Path, draft_dir: Path):
    """(requested, effective, SGLang's warnings) for a server command line, via SGLang's own parser
    and ServerArgs.resolve_once() on CPU. The target and draft paths are given unless the line does."""
    from sglang.srt.server_args import ServerArgs

    try:
        user = shlex.split(command_line)
    except ValueError as exc:
        raise CommandLineError(f"--sglang-args: {exc}") from None
    parser = _Parser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", str(target_dir), "--speculative-draft-model-path", str(draft_dir), *HOST_ARGS, *user]
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    requested = {k: compat.server_arg(server_args, k) for k in SHOWN}
    warnings: list[str] = []
    with _sglang_warnings(warnings), _environ_restored():
        try:
            server_args.resolve_once()
        except Exception as exc:   # SGLang refuses the combination: its own words, one line
            first = first_line(exc)
            raise CommandLineError(f"--sglang-args: SGLang refuses {command_line!r}: {first}") from None
    resolved = server_args.resolved_dict()
    return requested, {k: resolved.get(k) for k in SHOWN}, warnings


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
        if effective[k] is not None and effective[k] < 1.0:
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
        return Finding(entry.setting, requested[entry.setting], effective[entry.setting], MISMATCH, why, entry.id)
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
