"""Server flags on the user's draft: --sglang-args resolved by SGLang's own ServerArgs with the user's
draft and target config, and every setting that changes what this draft computes, as verdict problems.

Entry point (the verdict's user checks call it):

    check_user_settings(command_line, draft_dir, target_config, checkpoint, root) -> UserSettings
        `draft_dir`: the draft as SGLang reads it (the converted copy when SGLang cannot read the user's
        own); `checkpoint`: the user's DraftCheckpoint as given (its config says what training did).
        UserSettings.problems: verdict Problems (rank SETTINGS); .notes: changes the draft does not feel;
        .requested / .effective: every ServerArgs field, as the line gave it (None: not given) and as SGLang
        resolved it; .rows(): report rows. Raises CommandLineError (one line) when SGLang refuses the flags.

What the registry knows about SGLang's serving on the resolved settings is part of it: every applicable
`settings` entry (conformance/core/registry.toml) is a problem, merged into the observed one of the same
setting when a check below saw it, and every applicable `tree` entry (a tree draft SGLang serves unlike
training) is one, with the entry's reason and fix.

Every other setting, whatever its flag is called, is judged on the draft SGLang builds with it
(conformance/adapters/sglang/settings.py draft_view: the draft's ModelConfig, model and KV cache dtype under
the resolved line against under SGLang's defaults, each setting the build read tried alone): a problem
where the draft computes or stores otherwise than its file says (_draft_change), a note where it does not.

SGLang's side is its own code: the parser and resolve_once (conformance/adapters/sglang/settings.py), the
context length from its ModelConfig for the target and then for the draft with the target's context
(what the EAGLE worker does), the draft class from its ModelRegistry. The cause of each problem is the
line of the installed SGLang that decides it, found in its source (conformance/user/wiring.py).
"""
from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER
from conformance.checkpoints.directory import DraftCheckpoint
from conformance.checkpoints.errors import load_json
from conformance.core import areas, registry
from conformance.core.findings import SETTINGS, Problem
from conformance.user.problems import fix_for
from conformance.user.wiring import source_line

HOOK = "sglang.srt.arg_groups.speculative_hook"
WORKER = "sglang.srt.speculative.eagle_worker_v2"
DRAFT = "sglang.srt.models.llama_eagle3"
# SGLang's EAGLE-3 draft classes: its Llama draft, and its MLA draft (models/kimi_k25_eagle3.py EntryClass), the
# class of an MLA draft's own format (conformance/checkpoints/formats/sglang_mla.py).
EAGLE3_CLASSES = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
CONTEXT = "context_length"
# SGLang's own resolution, the default server's `server_settings`. CommandLineError: callers catch it from here.
SERVER_SETTINGS = ADAPTERS[DEFAULT_SERVER].server_settings
NUMBERS, CommandLineError, DraftChange, DraftView = (SERVER_SETTINGS.NUMBERS, SERVER_SETTINGS.CommandLineError,
                                                     SERVER_SETTINGS.DraftChange, SERVER_SETTINGS.DraftView)
draft_view, flag, resolve_line, shown = (SERVER_SETTINGS.draft_view, SERVER_SETTINGS.flag,
                                         SERVER_SETTINGS.resolve_line, SERVER_SETTINGS.shown)


@dataclass
class UserSettings:
    command_line: str
    requested: dict
    effective: dict
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)   # (setting, why): changes the draft does not feel

    def rows(self) -> list[dict]:
        """The chain's numbers, the context and every setting the line gave, then each problem's and note's
        setting, with its verdict."""
        settings = dict.fromkeys([*shown(self), CONTEXT, *(p.key.removeprefix("settings:") for p in self.problems),
                                  *(setting for setting, _ in self.notes)])
        rows = {k: {"command line": self.command_line, "setting": k, "requested": _show(self.requested.get(k)),
                    "effective": _show(self.effective.get(k)), "verdict": "", "why": ""} for k in settings}
        for setting, why in self.notes:
            rows[setting].update(verdict="note", why=why)
        for p in self.problems:
            rows[p.key.removeprefix("settings:")].update(verdict="problem", why=p.what)
        return list(rows.values())


def _show(value) -> str:
    return "(not given)" if value is None else str(value)


def _problem(setting: str, what: str, evidence: str, cause: str, fix: str) -> Problem:
    return Problem(what, f"server flag: {setting}", evidence, cause, fix, SETTINGS, key=f"settings:{setting}")


def trained_steps(checkpoint: DraftCheckpoint) -> int | None:
    """The TTT steps the checkpoint records (speculators: proposal_methods[0].speculative_tokens), or None."""
    raw = load_json(checkpoint.path / "config.json")
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") if isinstance(
        raw.get("speculators_config"), dict) else None
    steps = methods[0].get("speculative_tokens") if isinstance(methods, list) and methods and \
        isinstance(methods[0], dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def _draft_class(draft_dir: Path) -> str:
    from sglang.srt.models.registry import ModelRegistry

    arch = load_json(Path(draft_dir) / "config.json").get("architectures") or []
    try:
        return ModelRegistry.resolve_model_cls(arch)[0].__name__
    except Exception as exc:   # SGLang's registry: its own words
        return f"none ({str(exc).splitlines()[0]})"


def check_user_settings(command_line: str, draft_dir: Path, target_config: Path, checkpoint: DraftCheckpoint,
                        root: Path) -> UserSettings:
    target_dir = Path(root) / "target"   # SGLang reads <dir>/config.json; the user's file is only copied
    target_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target_config, target_dir / "config.json")
    line = resolve_line(command_line, target_dir, Path(draft_dir))
    view = draft_view(line)
    requested, effective = line.requested, line.effective
    effective[CONTEXT] = view.context   # the context the server runs: the target's, as SGLang builds it
    out = UserSettings(command_line, requested, effective, line.warnings)
    cfg = checkpoint.config
    out.problems += _numbers(requested, effective, line.warnings, trained_steps(checkpoint))
    out.problems += _algorithm(effective, _draft_class(Path(draft_dir)))
    out.problems += _window(effective, cfg.sliding_window)
    out.problems += _token_map(effective, cfg)
    out.problems += _embedding(checkpoint)
    out.problems += _context(view.context, view.draft_context, view.refused, cfg.max_position_embeddings)
    out.problems += _rejection_sampling(effective, cfg)
    out.problems += _registered(requested, effective, cfg, Path(draft_dir), out.problems)
    out.problems += _tree(effective, cfg)
    for change in view.changes:
        if f"settings:{change.setting}" not in {p.key for p in out.problems}:   # a check above has it, with its fix
            problem, notes = _draft_change(view, change)
            out.problems += [problem] if problem else []
            out.notes += [(change.setting, note) for note in notes]
    return out


# ---------------------------------------------------------------- the checks, one per setting

def _numbers(requested: dict, effective: dict, warnings: list[str], trained: int | None) -> list[Problem]:
    out = []
    steps, topk = effective["speculative_num_steps"], effective["speculative_eagle_topk"]
    for k in NUMBERS:
        asked, got = requested[k], effective[k]
        if asked is None or asked == got:
            continue
        said = next((w for w in warnings if k in w), "")
        evidence = f"requested {asked}, effective {got}" + (f"; SGLang's warning: {said!r}" if said else "")
        if k == "speculative_num_draft_tokens" and topk == 1:
            chain = min(asked - 1, trained) if trained else asked - 1
            out.append(_problem(k, f"draft tokens silently reduced: {asked} asked, {got} served",
                                f"{evidence} (= num_steps {steps} + 1 with topk 1)",
                                source_line(HOOK, "speculative_num_draft_tokens is adjusted"),
                                f"--speculative-num-steps {chain} --speculative-num-draft-tokens {chain + 1} "
                                f"(a chain of {chain} draft tokens)"))
        else:
            out.append(_problem(k, f"{k} changed by SGLang: {asked} asked, {got} served", evidence,
                                source_line(HOOK, "def _handle_eagle_family"), f"--{k.replace('_', '-')} {got}"))
    if trained and steps and steps > trained:
        out.append(_problem(
            "speculative_num_steps", f"more draft steps than the draft was trained for: {steps} > {trained}",
            f"speculative_num_steps {steps}; the checkpoint records {trained} TTT steps (speculators_config."
            f"proposal_methods[0].speculative_tokens): steps {trained + 1}..{steps} were never trained",
            source_line(WORKER, "n_inner = self.speculative_num_steps - 1"),
            f"--speculative-num-steps {trained} --speculative-num-draft-tokens {trained + 1} (with topk 1)"))
    return out


def _algorithm(effective: dict, draft_class: str) -> list[Problem]:
    algo = effective["speculative_algorithm"]
    if algo == "EAGLE3" and draft_class in EAGLE3_CLASSES:
        return []
    if algo != "EAGLE3":
        hook = source_line(HOOK, 'speculative_algorithm == "EAGLE"')
        fc = source_line(DRAFT, "!= embeds.shape[-1]")
        return [_problem("speculative_algorithm", f"--speculative-algorithm {algo} for an EAGLE-3 draft "
                                                  f"({draft_class})",
                         f"effective algorithm {algo}: the target captures no aux hidden states, so the draft gets "
                         "one hidden state and skips fc",
                         f"{hook} keeps {algo} without looking at the draft; {fc} runs fc only on the wider input",
                         "--speculative-algorithm EAGLE3")]
    return [_problem("speculative_algorithm", f"SGLang builds the draft as {draft_class}, not an EAGLE-3 draft",
                     f"draft config architectures -> {draft_class}; EAGLE3 needs one of {list(EAGLE3_CLASSES)}",
                     source_line("sglang.srt.models.registry", "def resolve_model_cls"),
                     'convert the draft to SGLang\'s format ("architectures": ["LlamaForCausalLMEagle3"])')]


def _window(effective: dict, trained: int | None) -> list[Problem]:
    flag = effective["speculative_draft_window_size"]
    if flag is None and trained is None:
        return []
    mask = source_line("sglang.srt.layers.attention.torch_native_backend", "k_pos >= q_pos - sliding_window_size")
    cause = (f"{source_line(DRAFT, 'sliding_window_size = self._draft_window_size')} sets the window from the flag "
             f"only; {mask} keeps flag + 1 keys, and the window slides with the draft chain")
    if trained is None:
        evidence = f"flag {flag}: every draft layer attends to {flag + 1} keys; trained with full attention"
        return [_problem("speculative_draft_window_size", "a draft window the draft was not trained with", evidence,
                         cause, "drop --speculative-draft-window-size")]
    if flag is None:
        evidence = f"the draft was trained with sliding_window {trained}; without the flag SGLang attends to every key"
        fix = (f"--speculative-draft-window-size {trained - 1} matches draft step 0 only; to be served as trained at "
               "every step: retrain without sliding_window")
    else:
        evidence = f"flag {flag} keeps {flag + 1} keys; trained window {trained} keys" + (
            ", equal at draft step 0 but sliding with the chain at steps >= 1" if flag == trained - 1 else "")
        fix = "retrain without sliding_window (SGLang cannot serve a draft window as speculators trains it)"
    return [_problem("speculative_draft_window_size", "the draft window is served differently from training",
                     evidence, cause, fix)]


def _token_map(effective: dict, cfg) -> list[Problem]:
    path = effective["speculative_token_map"]
    if path is None:
        return []
    return [_problem("speculative_token_map", "the token map flag is not what the draft uses",
                     f"--speculative-token-map {path} is ignored for EAGLE3: SGLang warns and uses the checkpoint's "
                     f"d2t ({cfg.draft_vocab_size} of {cfg.vocab_size} ids)",
                     source_line(WORKER, "EAGLE3 models already have this"),
                     "drop --speculative-token-map; the draft's own d2t is its vocabulary map")]


def _embedding(checkpoint: DraftCheckpoint) -> list[Problem]:
    raw = load_json(checkpoint.path / "config.json")
    if not raw.get("embed_requires_grad") or "embed_tokens.weight" not in checkpoint.tensors:
        return []
    return [_problem("embed_tokens", "the draft's own trained embed_tokens is replaced by the target's",
                     "embed_requires_grad true: the draft trained its embedding, SGLang serves the target's",
                     source_line(WORKER, "self.draft_runner.model.set_embed(embed)"),
                     "retrain with the target's embedding frozen (embed_requires_grad false)")]


def _context(ctx: int, draft_ctx: int | None, refused: str, max_pos: int) -> list[Problem]:
    if ctx <= min(draft_ctx or max_pos, max_pos):
        return []
    evidence = f"the server runs context {ctx}; the draft's max_position_embeddings is {max_pos}" + (
        f"; SGLang refuses to start: {refused!r}" if refused else "")
    worker = source_line(WORKER, "context_length=target_worker.model_runner.model_config.context_len")
    derive = source_line("sglang.srt.configs.model_config", "def _derive_context_length")
    return [_problem(CONTEXT, "the server's context is longer than the draft's positions", evidence,
                     f"{worker} builds the draft with the target's context; {derive} refuses it, or with "
                     "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 overrides the draft's max_position_embeddings",
                     f"--context-length {min(draft_ctx, max_pos)}")]


def _rejection_sampling(effective: dict, cfg) -> list[Problem]:
    if not effective["speculative_use_rejection_sampling"] or cfg.draft_vocab_size == cfg.vocab_size:
        return []
    return [_problem("speculative_use_rejection_sampling", "SGLang refuses to start the draft with rejection sampling",
                     f"the draft's vocabulary is {cfg.draft_vocab_size} of the target's {cfg.vocab_size} ids; "
                     "rejection sampling needs one vocabulary",
                     source_line(WORKER, "--speculative-use-rejection-sampling requires the draft"),
                     "drop --speculative-use-rejection-sampling")]


# ---------------------------------------------------------------- the draft the resolved settings build

SHOWN_DIFFERENCES = 6   # the evidence names this many differing attributes of the draft's model, then counts the rest


def _differences(file: dict, served: dict) -> list[str]:
    return [f"{k}: {_show(file.get(k))} -> {_show(served.get(k))}" for k in dict.fromkeys([*file, *served])
            if file.get(k) != served.get(k)]


def _draft_change(view: DraftView, change: DraftChange) -> tuple[Problem | None, list[str]]:
    """(the problem, the notes) of one resolved setting that builds another draft than its file describes.
    A problem where what the draft computes or stores is not what training had: its config as the model
    SGLang builds reads it, weights quantized, a cast between the two 16-bit formats, a KV cache stored
    below the draft's own dtype. A note where the change does not reach that far: a config field the model
    never reads, an upcast, or a downcast from float32 (what the bf16 checks verify)."""
    file, served = view.file, change.served
    effects, notes = [], []
    config, model = _differences(file.config, served.config), _differences(file.module, served.module)
    if model:
        more = f" (and {len(model) - SHOWN_DIFFERENCES} more)" if len(model) > SHOWN_DIFFERENCES else ""
        effects.append((f"the draft's config is served otherwise ({', '.join(k.split(':')[0] for k in config)})",
                        f"its config.json as SGLang reads it -> as served: {'; '.join(config) or 'the same'}; the "
                        f"model SGLang builds from it: {'; '.join(model[:SHOWN_DIFFERENCES])}{more}"))
    elif config:
        notes.append(f"{'; '.join(config)}: the model SGLang builds for the draft is the same (it reads none of them)")
    if served.quantization != file.quantization:
        effects.append((f"the draft's weights are quantized at load ({served.quantization})",
                        f"quantization: the draft's file {file.quantization or 'none'}, served {served.quantization}"))
    if served.dtype != file.dtype:
        words = f"dtype {file.dtype} -> {served.dtype}; the draft's config says its weights are {served.stored}"
        if served.dtype == served.stored or torch.float32 in (served.dtype, served.stored):
            notes.append(f"{words}: {'an upcast' if served.dtype == torch.float32 else 'a downcast from float32'}, "
                         "within the precision the bf16 checks verify")
        else:   # between the two 16-bit formats: range and rounding the draft was not trained with
            effects.append((f"the draft computes in {served.dtype}, its weights are {served.stored}", words))
    if served.kv_cache_dtype != file.kv_cache_dtype and served.kv_cache_dtype != served.dtype:
        effects.append((f"the draft's KV cache stores keys and values in {served.kv_cache_dtype}",
                        f"KV cache dtype {file.kv_cache_dtype} -> {served.kv_cache_dtype}; the draft computes in "
                        f"{served.dtype} and was trained attending over keys and values in its own dtype"))
    if not effects:
        return None, notes
    setting, given = change.setting, change.flag
    derived = f"; SGLang derives it at {source_line(*change.derived_by)}" if change.derived_by else ""
    fix = f"drop {given}" if given == flag(setting) else (
        f"give {flag(setting)} explicitly: SGLang resolves it to {change.value}"
        + (f" from {given}" if given else "") + f" (without the flags: {_show(change.default)})")
    return Problem("; ".join(what for what, _ in effects), f"server setting: {setting}" + (
                       f" (from {given})" if given else ""), "; ".join(e for _, e in effects),
                   f"the draft's worker builds it with this setting, as the target's "
                   f"({source_line(*change.read_at)}){derived}", fix, SETTINGS, key=f"settings:{setting}"), notes


# ---------------------------------------------------------------- what the registry knows

def _registered(requested: dict, effective: dict, cfg, draft_dir: Path, found: list[Problem]) -> list[Problem]:
    """The registry's `settings` entries for the installed SGLang that hold on the resolved settings and the
    draft: the problem a check above found for the same setting gets the entry's id and reason; any other is
    a problem of its own. The speculative numbers are SGLang's own resolution, a problem only where it changed
    what was asked (a check above); the embedding only where the draft's differs from the target's, which its
    config says (embed_requires_grad: a check above)."""
    raw = load_json(draft_dir / "config.json")
    names = {**dataclasses.asdict(cfg), **{k: effective.get(k) for k in areas.SERVER_SETTINGS},
             "config_has_draft_vocab_size": raw.get("draft_vocab_size") is not None}
    seen = {p.key: p for p in found}
    out = []
    for entry in registry.applicable("settings", DEFAULT_SERVER, names):
        key = f"settings:{entry.setting}"
        if key in seen:
            problem = seen[key]
            if not problem.known:
                problem.known = entry.id
                problem.cause += f"; the registry's {entry.id}: {entry.reason}"
            continue
        if entry.setting in NUMBERS or entry.setting == "embed_tokens":
            continue
        evidence = (f"{entry.setting}: requested {_show(requested.get(entry.setting))}, effective "
                    f"{_show(effective[entry.setting])}"
                    if entry.setting in effective else f"the draft's config.json (as SGLang reads it): {entry.when}")
        out.append(_registered_problem(entry, evidence, fix_for(entry, cfg)))
    return out


def _registered_problem(entry: registry.Known, evidence: str, fix: str, key: str = "") -> Problem:
    how = f" ({areas.ASSERTED}: no check here runs SGLang's code for it)" if entry.asserted else ""
    return Problem(f"SGLang serves {entry.setting} otherwise than the draft was trained ({entry.id})",
                   f"server setting: {entry.setting}", f"{evidence}; the registry's condition holds: {entry.when}{how}",
                   entry.reason, fix, SETTINGS, key=key or f"settings:{entry.setting}", known=entry.id,
                   impl=DEFAULT_SERVER)


def _tree(effective: dict, cfg) -> list[Problem]:
    """The registry's `tree` entries that hold for the tree these settings draft (topk > 1): SGLang's tree draft
    departs from the reference tree (shown on tiny drafts by conformance/draft/test_tree.py)."""
    topk, steps = effective["speculative_eagle_topk"] or 1, effective["speculative_num_steps"] or 1
    tokens = effective["speculative_num_draft_tokens"]
    names = {**dataclasses.asdict(cfg), "topk": topk, "steps": steps, "num_draft_tokens": tokens}
    return [Problem(f"SGLang's tree draft departs from training semantics ({entry.id})",
                    f"server flags: topk {topk}, {steps} steps, {tokens} draft tokens; draft step {entry.step}, "
                    f"stage `{entry.stage}`",
                    f"the registry's entry holds for this tree ({entry.when}) on sglang "
                    f"{registry.installed_version(DEFAULT_SERVER)}: the tree check on tiny drafts "
                    f"(conformance/draft/test_tree.py) first diverges at draft step {entry.step}, `{entry.stage}`",
                    entry.reason, fix_for(entry, cfg), SETTINGS, key=f"tree:{entry.id}", known=entry.id,
                    impl=DEFAULT_SERVER)
            for entry in registry.applicable("tree", DEFAULT_SERVER, names)]
