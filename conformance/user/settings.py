"""Server flags on the user's draft: --sglang-args resolved by SGLang's own ServerArgs with the user's
draft and target config, and every setting that changes what this draft computes, as verdict problems.

Entry point (the verdict's user checks call it):

    check_user_settings(command_line, draft_dir, target_config, checkpoint, root) -> UserSettings
        `draft_dir`: the draft as SGLang reads it (the converted copy when SGLang cannot read the user's
        own); `checkpoint`: the user's DraftCheckpoint as given (its config says what training did).
        UserSettings.problems: verdict Problems (rank SETTINGS); .requested / .effective: SGLang's values;
        .rows(): report rows. Raises CommandLineError (one line) when SGLang refuses the flags.

What the registry knows about SGLang's serving on the resolved settings is part of it: every applicable
`settings` entry (conformance/core/registry.toml) is a problem, merged into the observed one of the same
setting when a check below saw it, and every applicable `tree` entry (a tree draft SGLang serves unlike
training) is one, with the entry's reason and fix.

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

from conformance.adapters.sglang.settings import HOST_ARGS, NUMBERS, CommandLineError, resolve  # noqa: F401
# CommandLineError is re-exported: callers catch it from here.
from conformance.checkpoints.directory import DraftCheckpoint
from conformance.checkpoints.errors import load_json
from conformance.core import areas, registry
from conformance.core.findings import SETTINGS, Problem
from conformance.user.problems import fix_for
from conformance.user.wiring import source_line

HOOK = "sglang.srt.arg_groups.speculative_hook"
WORKER = "sglang.srt.speculative.eagle_worker_v2"
DRAFT = "sglang.srt.models.llama_eagle3"
EAGLE3_CLASSES = ("LlamaForCausalLMEagle3",)
CONTEXT = "context_length"


@dataclass
class UserSettings:
    command_line: str
    requested: dict
    effective: dict
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def rows(self) -> list[dict]:
        rows = [{"command line": self.command_line, "setting": k, "requested": _show(self.requested.get(k)),
                 "effective": _show(self.effective.get(k)), "verdict": "", "why": ""}
                for k in dict.fromkeys([*self.requested, *self.effective])]
        by_setting = {r["setting"]: r for r in rows}
        for p in self.problems:
            row = by_setting.get(p.key.removeprefix("settings:"))
            if row is not None:
                row.update(verdict="problem", why=p.what)
        return rows


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


def asked(command_line: str, target_dir: Path, draft_dir: Path):
    """SGLang's ServerArgs as parsed from the line, before resolution (what was asked for). The line has
    passed resolve() already, so SGLang's parser accepts it."""
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", str(target_dir), "--speculative-draft-model-path", str(draft_dir), *HOST_ARGS,
            *shlex.split(command_line)]
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def context_lengths(server_args, target_dir: Path, draft_dir: Path) -> tuple[int, int, str]:
    """(the context the server runs, the draft's own maximum, SGLang's words when it refuses the pair),
    from SGLang's ModelConfig: the target's, then the draft's with the target's context length, as the
    EAGLE worker builds it."""
    from sglang.srt.configs.model_config import ModelConfig

    common = dict(trust_remote_code=server_args.trust_remote_code,
                  model_override_args=server_args.json_model_override_args or "{}")
    target = ModelConfig(str(target_dir), context_length=server_args.context_length, **common).context_len
    draft = ModelConfig(str(draft_dir), is_draft_model=True, trust_remote_code=server_args.trust_remote_code)
    try:
        ModelConfig(str(draft_dir), is_draft_model=True, context_length=target,
                    trust_remote_code=server_args.trust_remote_code)
        refused = ""
    except ValueError as exc:   # SGLang's own refusal, first sentence
        refused = str(exc).split(". ")[0]
    return target, draft.context_len, refused


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
    requested, effective, warnings = resolve(command_line, target_dir, Path(draft_dir))
    server_args = asked(command_line, target_dir, Path(draft_dir))
    ctx, draft_ctx, refused = context_lengths(server_args, target_dir, Path(draft_dir))
    requested[CONTEXT], effective[CONTEXT] = server_args.context_length, ctx
    out = UserSettings(command_line, requested, effective, warnings)
    cfg = checkpoint.config
    out.problems += _numbers(requested, effective, warnings, trained_steps(checkpoint))
    out.problems += _algorithm(effective, _draft_class(Path(draft_dir)))
    out.problems += _window(effective, cfg.sliding_window)
    out.problems += _token_map(effective, cfg)
    out.problems += _embedding(checkpoint)
    out.problems += _context(ctx, draft_ctx, refused, cfg.max_position_embeddings)
    out.problems += _rejection_sampling(effective, cfg)
    out.problems += _registered(requested, effective, cfg, Path(draft_dir), out.problems)
    out.problems += _tree(effective, cfg)
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


def _context(ctx: int, draft_ctx: int, refused: str, max_pos: int) -> list[Problem]:
    if ctx <= min(draft_ctx, max_pos):
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
    for entry in registry.applicable("settings", "sglang", names):
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
                   entry.reason, fix, SETTINGS, key=key or f"settings:{entry.setting}", known=entry.id, impl="sglang")


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
                    f"{registry.installed_version('sglang')}: the tree check on tiny drafts "
                    f"(conformance/draft/test_tree.py) first diverges at draft step {entry.step}, `{entry.stage}`",
                    entry.reason, fix_for(entry, cfg), SETTINGS, key=f"tree:{entry.id}", known=entry.id,
                    impl="sglang")
            for entry in registry.applicable("tree", "sglang", names)]
