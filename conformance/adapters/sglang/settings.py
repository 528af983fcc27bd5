"""SGLang's effective speculative settings: a server command line, requested vs effective.

The command line goes through SGLang's own parser (ServerArgs.add_cli_args, from_cli_args) and its
own resolution (resolve_once: the speculative hook included) on CPU, with the target's config and
the draft's; the effective values are SGLang's resolved_dict(). The serving behaviours of
eagle3-semantics.md §5 that silently change what a trained draft does are listed next to them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

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
    """Collect what SGLang logs while resolving (its own words for each adjustment)."""
    class Collect(logging.Handler):
        def emit(self, record):
            out.append(record.getMessage())

    handler, logger = Collect(level=logging.WARNING), logging.getLogger("sglang")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


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
    requested = {k: getattr(server_args, k) for k in SHOWN}
    warnings: list[str] = []
    with _sglang_warnings(warnings), _environ_restored():
        try:
            server_args.resolve_once()
        except Exception as exc:   # SGLang refuses the combination: its own words, one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CommandLineError(f"--sglang-args: SGLang refuses {command_line!r}: {first}") from None
    resolved = server_args.resolved_dict()
    return requested, {k: resolved[k] for k in SHOWN}, warnings


def effective_settings(command_line: str, target_dir: Path, draft_dir: Path, facts: DraftFacts) -> EffectiveSettings:
    requested, effective, warnings = resolve(command_line, target_dir, draft_dir)
    out = EffectiveSettings(command_line, requested, effective, warnings)
    out.findings = findings(requested, effective, warnings, facts, target_architecture(target_dir))
    return out


def target_architecture(target_dir: Path) -> str:
    return json.loads((Path(target_dir) / "config.json").read_text())["architectures"][0]


def findings(requested: dict, effective: dict, warnings: list[str], facts: DraftFacts, arch: str) -> list[Finding]:
    """Each way the served draft differs from what was asked for or what it was trained on."""
    out: list[Finding] = []
    cfg = facts.config
    auto = all(requested[k] is None for k in NUMBERS)
    for k in NUMBERS:
        asked, got = requested[k], effective[k]
        if asked is None:
            out.append(Finding(k, None, got, NOTE,
                               f"auto-chosen by SGLang for a {arch} target (speculative_hook.py:1159-1174, 1430-1461)"
                               if auto else "derived by SGLang's resolution (speculative_hook.py)"))
        elif asked != got:
            why = "changed by SGLang's resolution"
            if k == "speculative_num_draft_tokens" and effective["speculative_eagle_topk"] == 1:
                said = next((w for w in warnings if "speculative_num_draft_tokens is adjusted" in w), "")
                why = (f"with topk == 1 SGLang drafts a chain and sets num_draft_tokens = num_steps + 1 = {got} "
                       f"(arg_groups/speculative_hook.py:1255-1266): at most {got} tokens per verify round"
                       + (f"; SGLang's warning: {said!r}" if said else ""))
            out.append(Finding(k, asked, got, MISMATCH, why))
    if (effective["speculative_eagle_topk"] or 1) > 1:
        out.append(Finding("speculative_eagle_topk", requested["speculative_eagle_topk"], effective["speculative_eagle_topk"],
                           NOTE, "tree drafting (topk > 1): 1 + sum_k full_acc_k predicts chain drafting only"))
    steps = effective["speculative_num_steps"]
    if steps is not None and steps > facts.trained_steps:
        out.append(Finding("speculative_num_steps", requested["speculative_num_steps"], steps, MISMATCH,
                           f"drafts {steps} steps, but the draft was trained for {facts.trained_steps} TTT steps "
                           f"(speculators_config.proposal_methods[0].speculative_tokens): steps "
                           f"{facts.trained_steps + 1}..{steps} were never trained"))
    if effective["speculative_algorithm"] != "EAGLE3":
        out.append(Finding("speculative_algorithm", requested["speculative_algorithm"], effective["speculative_algorithm"],
                           MISMATCH, "the draft is an EAGLE-3 draft (LlamaForCausalLMEagle3)"))
    if effective["speculative_token_map"] is not None:
        out.append(Finding("speculative_token_map", requested["speculative_token_map"], effective["speculative_token_map"],
                           MISMATCH, "ignored for EAGLE-3 (warning only): SGLang uses the checkpoint's d2t "
                                     "(speculative/eagle_worker_v2.py:323-331)"))
    out += _embed_and_head(facts)
    out += _window(effective, facts)
    if effective["speculative_use_rejection_sampling"] and cfg.draft_vocab_size != cfg.vocab_size:
        out.append(Finding("speculative_use_rejection_sampling", requested["speculative_use_rejection_sampling"], True,
                           MISMATCH, f"SGLang refuses to start: rejection sampling needs one vocabulary, the draft's is "
                                     f"{cfg.draft_vocab_size} of {cfg.vocab_size} (speculative/eagle_worker_v2.py:259-273)"))
    for k in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        if effective[k] is not None and effective[k] < 1.0:
            out.append(Finding(k, requested[k], effective[k], NOTE,
                               "relaxed acceptance when sampling (arg_groups/fields/spec.py:109-116): accept length above "
                               "the greedy chain's"))
    if requested["max_running_requests"] is None:
        out.append(Finding("max_running_requests", None, effective["max_running_requests"], NOTE,
                           "set for speculative decoding (speculative_hook.py:1088-1097)"))
    out.append(_aux_layers(facts))
    out.append(Finding("verification", None, "greedy (argmax over the full target vocabulary)", NOTE,
                       "CPU hosts and all-greedy batches verify greedily (speculative/eagle_utils.py:485-500); "
                       "the simulated accept length uses the same rule"))
    return out


def _embed_and_head(facts: DraftFacts) -> list[Finding]:
    raw = facts.sglang_config
    out = []
    if raw.get("target_hidden_size", raw["hidden_size"]) == raw["hidden_size"]:
        same = facts.draft_embed.shape == facts.target_embed.shape and torch.equal(facts.draft_embed, facts.target_embed)
        diff = None if same or facts.draft_embed.shape != facts.target_embed.shape else \
            float((facts.draft_embed - facts.target_embed).abs().max())
        out.append(Finding(
            "embed_tokens", "the draft's", "the target's", NOTE if same else MISMATCH,
            "SGLang replaces the draft's embedding with the target's (speculative/eagle_worker_v2.py:355-363, "
            "models/llama.py:910-918): " + ("no effect, they are identical (speculators trains with the target's "
                                             "frozen embedding)" if same else
                                             f"they differ (max abs {diff:.3e})" if diff is not None else
                                             "they differ in shape")))
    if raw.get("draft_vocab_size") is None and not raw.get("tie_word_embeddings"):
        out.append(Finding("lm_head", "the draft's", "the target's", MISMATCH,
                           "no draft_vocab_size in the config: SGLang loads the target's lm_head "
                           "(models/llama_eagle3.py:302-307, eagle_worker_v2.py:355-360)"))
    return out


def _window(effective: dict, facts: DraftFacts) -> list[Finding]:
    flag, trained = effective["speculative_draft_window_size"], facts.config.sliding_window
    out = []
    if flag is not None and trained is None:
        out.append(Finding("speculative_draft_window_size", flag, flag, MISMATCH,
                           f"every draft layer attends to {flag + 1} keys (the window is exclusive, "
                           f"torch_native_backend.py:48; models/llama_eagle3.py:286-299); the draft was trained "
                           f"with full attention"))
    elif trained is not None and flag is None:
        out.append(Finding("speculative_draft_window_size", None, None, MISMATCH,
                           f"the draft was trained with sliding_window {trained}; SGLang never reads it, only the "
                           f"flag sets a window (models/llama_eagle3.py:286-299): full attention"))
    elif trained is not None and flag != trained - 1:
        out.append(Finding("speculative_draft_window_size", flag, flag, MISMATCH,
                           f"trained window {trained} keys; SGLang's window is exclusive ({flag + 1} keys, "
                           f"torch_native_backend.py:48)"))
    elif trained is not None:
        out.append(Finding("speculative_draft_window_size", flag, flag, MISMATCH,
                           f"{flag + 1} keys at step 0 as trained, but the window slides with the chain at steps >= 1 "
                           f"(torch_native_backend.py:48); training keeps the step-0 window (speculators "
                           f"attention.py:11-34)"))
    if effective["speculative_draft_sink_size"] is not None:
        out.append(Finding("speculative_draft_sink_size", effective["speculative_draft_sink_size"],
                           effective["speculative_draft_sink_size"], MISMATCH,
                           "ignored by the Llama EAGLE-3 draft (models/llama_eagle3.py:286-299 reads the window only)"))
    return out


def _aux_layers(facts: DraftFacts) -> Finding:
    """Which target layers SGLang captures for this draft, in the training convention (input of layer i)."""
    eagle = facts.sglang_config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    n = facts.target_layers
    if ids is None:   # spec_aux_hidden_state.py:185-196 -> None -> the target's default list, no +1
        served, how = (2, n // 2, n - 3), "no eagle_config: the target's default list (models/llama.py:933-936)"
    else:
        served, how = tuple(i + 1 for i in ids), "eagle_config ids + 1 (models/llama.py:937-941)"
    trained = facts.config.aux_layer_ids or (2, n // 2, n - 3)
    return Finding("aux layers captured", tuple(trained), served, NOTE if tuple(trained) == served else MISMATCH,
                   f"{how}; trained on {tuple(trained)}")


def draft_facts(speculators_dir: Path, sglang_dir: Path, target_dir: Path, config: Eagle3Config) -> DraftFacts:
    from fixtures.checkpoint import WEIGHTS_FILE

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
                      target_layers=target["num_hidden_layers"])
