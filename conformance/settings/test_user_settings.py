"""Server flags on the user's draft (conformance/user/settings.py): --sglang-args resolved by
SGLang's own ServerArgs with the user's draft and a real target config.

Each setting that changes what the draft computes is planted on its own and must come back as exactly
that problem, with a cause that is a real line of the installed SGLang; the chain within the trained
steps, at a context the draft covers, comes back clean; the seed's flags show the 16 -> 2 draft tokens.
Flags of any name that change the draft SGLang builds are problems too; flags that build the same draft
are none, and a read SGLang is planted to make of a harmless flag is found without naming it.
"""
from __future__ import annotations

import json
import logging
import logging.config
import os
import re
from pathlib import Path

import pytest
import torch

from conformance.checkpoints.directory import open_checkpoint
from conformance.core.areas import ASSERTED
from conformance.core.registry import REGISTRY
from conformance.user.settings import CommandLineError, check_user_settings
from fixtures.checkpoint import write_checkpoints
from fixtures.real_configs import REAL_CONFIGS
from fixtures.tiny import make_config, make_draft_weights

pytestmark = pytest.mark.cpu
LLAMA = REAL_CONFIGS / "target" / "meta-llama--Meta-Llama-3.1-8B.json"    # context 131072
KIMI = REAL_CONFIGS / "target" / "moonshotai--Kimi-K2.5.json"             # context 262144
SEED_ARGS = "--speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 16"
CHAIN = "--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4"   # 3 TTT steps
LONG = 131072
OVERRIDE = "--json-model-override-args '{}'"
ROPE_SCALING = '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'
EPS = '{"rms_norm_eps": 0.001}'


def user_draft(root: Path, edit_config=None, **knobs) -> tuple[Path, object]:
    """(the directory SGLang reads, the user's checkpoint as given: speculators format, 3 TTT steps)."""
    cfg = make_config(hidden_size=40, target_hidden_size=40, **{"max_position_embeddings": LONG, **knobs})
    dirs = write_checkpoints(cfg, make_draft_weights(cfg, torch.Generator().manual_seed(0)), root)
    if edit_config:
        path = dirs["speculators"] / "config.json"
        path.write_text(json.dumps(edit_config(json.loads(path.read_text()))))
    return dirs["sglang"], open_checkpoint(dirs["speculators"])


def settings(tmp_path, command_line, target=LLAMA, **draft):
    served, checkpoint = user_draft(tmp_path / "draft", **draft)
    return check_user_settings(command_line, served, target, checkpoint, tmp_path / "work")


def assert_real_cause(problem) -> None:
    """Every `sglang/...py:N` the cause names is a line of the installed package."""
    import sglang

    refs = re.findall(r"(sglang/[\w/]+\.py):(\d+)", problem.cause)
    assert refs, f"{problem.key}: no SGLang file:line in the cause: {problem.cause}"
    root = Path(sglang.__file__).parent.parent
    for path, line in refs:
        lines = (root / path).read_text().splitlines()
        assert 0 < int(line) <= len(lines), f"{problem.key}: {path}:{line} is not a line of the installed file"


def test_seed_flags_show_the_draft_tokens_reduced(tmp_path):
    result = settings(tmp_path, SEED_ARGS)
    found = {p.key: p for p in result.problems}
    problem = found.get("settings:speculative_num_draft_tokens")
    assert problem is not None, f"16 -> 2 draft tokens not reported: {[p.what for p in result.problems]}"
    assert "16 asked, 2 served" in problem.what and "speculative_num_draft_tokens is adjusted" in problem.evidence
    assert (result.requested["speculative_num_draft_tokens"], result.effective["speculative_num_draft_tokens"]) == \
        (16, 2)
    import sglang

    path, line = re.search(r"(sglang/[\w/]+\.py):(\d+)", problem.cause).groups()
    text = (Path(sglang.__file__).parent.parent / path).read_text().splitlines()[int(line) - 1]
    assert "speculative_num_draft_tokens is adjusted" in text, f"{problem.cause} points at {text!r}"
    assert "--speculative-num-steps 3 --speculative-num-draft-tokens 4" in problem.fix, problem.fix
    assert not re.search(r"topk\s*(>\s*1|[2-9])", problem.fix), problem.fix   # a chain, never a tree: registry


def test_chain_within_the_trained_steps_is_served_as_trained(tmp_path):
    """Clean, and SGLang's resolution leaves this process's environment as it was (it writes switches
    into os.environ; the next check must not see them)."""
    before = dict(os.environ)
    result = settings(tmp_path, CHAIN)
    assert result.problems == [], [f"{p.what}: {p.evidence}" for p in result.problems]
    assert result.effective["context_length"] == LONG
    assert dict(os.environ) == before, "checking the settings changed os.environ"


def _embed_trained(raw: dict) -> dict:
    return {**raw, "embed_requires_grad": True}


KNOWN = {e.id: e for e in REGISTRY}
# (id, command line, draft knobs, the one problem expected)
PLANTED = (
    ("more_steps_than_trained", "--speculative-eagle-topk 1 --speculative-num-steps 5 --speculative-num-draft-tokens 6",
     {}, "settings:speculative_num_steps"),
    ("eagle_not_eagle3", CHAIN + " --speculative-algorithm EAGLE", {}, "settings:speculative_algorithm"),
    ("window_flag_on_full_attention", CHAIN + " --speculative-draft-window-size 4", {},
     "settings:speculative_draft_window_size"),
    ("trained_window_without_flag", CHAIN, {"sliding_window": 4}, "settings:speculative_draft_window_size"),
    ("trained_window_with_matching_flag", CHAIN + " --speculative-draft-window-size 3", {"sliding_window": 4},
     "settings:speculative_draft_window_size"),
    ("token_map", CHAIN + " --speculative-token-map hot.pt", {}, "settings:speculative_token_map"),
    ("own_embedding_replaced", CHAIN, {"edit_config": _embed_trained}, "settings:embed_tokens"),
    ("context_beyond_positions", CHAIN, {"max_position_embeddings": 2048}, "settings:context_length"),
    ("rejection_sampling_pruned_vocab", CHAIN + " --speculative-use-rejection-sampling", {},
     "settings:speculative_use_rejection_sampling"),
    # The registry's tree entry, on the resolved settings: a tree SGLang drafts otherwise than training.
    ("tree_of_three_steps", "--speculative-eagle-topk 2 --speculative-num-steps 3 --speculative-num-draft-tokens 6",
     {}, "tree:sglang-tree-kv-follows-row-slots"),
    # Flags meant for the target that SGLang applies to the draft too, none of them speculative_*: the
    # draft's own build (ModelConfig.from_server_args) reads them. The rope override also lengthens the
    # target's context (x 2), held at the draft's here.
    ("rope_scaling_override", f"{CHAIN} --context-length {LONG} {OVERRIDE.format(ROPE_SCALING)}", {},
     "settings:json_model_override_args"),
    ("norm_eps_override", f"{CHAIN} {OVERRIDE.format(EPS)}", {}, "settings:json_model_override_args"),
    ("quantization_derived_for_the_draft", CHAIN + " --quantization fp8", {},
     "settings:speculative_draft_model_quantization"),
    ("fp8_kv_cache", CHAIN + " --kv-cache-dtype fp8_e4m3", {}, "settings:kv_cache_dtype"),
)


@pytest.mark.parametrize("command_line,draft,key", [pytest.param(c, d, k, id=i) for i, c, d, k in PLANTED])
def test_each_setting_that_changes_the_draft_is_one_problem(command_line, draft, key, tmp_path):
    result = settings(tmp_path, command_line, **draft)
    assert [p.key for p in result.problems] == [key], [f"{p.key}: {p.what}" for p in result.problems]
    problem = result.problems[0]
    assert problem.what and problem.evidence and problem.fix, problem
    assert not re.search(r"topk\s*(>\s*1|[2-9])", problem.fix), problem.fix   # no fix proposes a tree
    if problem.known:   # a registry entry's reason names the lines in its own short form
        assert problem.known in problem.what or problem.known in problem.cause, problem
        # the registry's own problem names its entry in `what` (user/settings.py _registered_problem), one a check
        # saw cites it in its cause: only the former, of an entry labelled asserted, says "asserted, not observed"
        observed = problem.known not in problem.what
        assert (ASSERTED in problem.evidence) == (KNOWN[problem.known].asserted and not observed), problem.evidence
    else:
        assert_real_cause(problem)


def test_context_is_sglangs_own_and_the_fix_clears_it(tmp_path):
    """Kimi-K2.5 runs 262144 tokens; a 131072-position draft is refused by SGLang's own ModelConfig, and
    the fix (--context-length) is served as trained."""
    long = settings(tmp_path / "a", CHAIN, target=KIMI)
    problem = {p.key: p for p in long.problems}.get("settings:context_length")
    assert problem is not None and "262144" in problem.evidence and "refuses" in problem.evidence, long.problems
    assert problem.fix == f"--context-length {LONG}", problem.fix
    fixed = settings(tmp_path / "b", f"{CHAIN} {problem.fix}", target=KIMI)
    assert fixed.problems == [], [p.what for p in fixed.problems]


@pytest.mark.meta
@pytest.mark.parametrize("command_line", ["--bogus-flag 3", "--speculative-num-steps three"])
def test_bad_command_line_is_one_line(command_line, tmp_path):
    with pytest.raises(CommandLineError) as caught:
        settings(tmp_path, command_line)
    assert str(caught.value).startswith("--sglang-args:") and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.cpu
def test_sglang_words_are_seen_whatever_configured_logging_before(tmp_path):
    """In a whole run, SGLang's Engine and uvicorn configure logging before this check: disabled or
    silenced loggers must not hide SGLang's own warning from the evidence (it did, in CI)."""
    import sglang.srt.arg_groups.speculative_hook  # noqa: F401  the module logger exists before the reconfiguration

    sglang_loggers = {name: lg for name, lg in logging.root.manager.loggerDict.items()
                      if isinstance(lg, logging.Logger) and name.startswith("sglang")}
    saved = {name: (lg.disabled, lg.level, lg.propagate) for name, lg in sglang_loggers.items()}
    try:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": True})
        logging.getLogger("sglang").setLevel(logging.CRITICAL)
        problem = {p.key: p for p in settings(tmp_path, SEED_ARGS).problems}["settings:speculative_num_draft_tokens"]
    finally:
        for name, (disabled, level, propagate) in saved.items():
            lg = sglang_loggers[name]
            lg.disabled, lg.propagate = disabled, propagate
            lg.setLevel(level)
    assert "speculative_num_draft_tokens is adjusted" in problem.evidence, problem.evidence


def _stored_bf16(raw: dict) -> dict:
    return {**raw, "torch_dtype": "bfloat16"}


def test_a_cast_between_the_16_bit_formats_is_a_problem_and_a_downcast_from_float32_a_note(tmp_path):
    """A draft stored in bf16 computed in fp16 (--dtype float16): range and rounding it was not trained with;
    a float32 draft computed in bf16 is what the bf16 checks verify: a note, not a problem."""
    served, checkpoint = user_draft(tmp_path / "bf16")
    config = served / "config.json"
    config.write_text(json.dumps(_stored_bf16(json.loads(config.read_text()))))
    cast = check_user_settings(f"{CHAIN} --dtype float16", served, LLAMA, checkpoint, tmp_path / "work-bf16")
    assert [p.key for p in cast.problems] == ["settings:dtype"], [f"{p.key}: {p.what}" for p in cast.problems]
    assert "torch.float16" in cast.problems[0].what and "torch.bfloat16" in cast.problems[0].evidence, cast.problems
    assert cast.problems[0].fix == "drop --dtype", cast.problems[0].fix
    assert_real_cause(cast.problems[0])
    down = settings(tmp_path / "fp32", f"{CHAIN} --dtype bfloat16")
    assert down.problems == [] and [k for k, _ in down.notes] == ["dtype"], (down.problems, down.notes)


@pytest.mark.meta
@pytest.mark.parametrize("flags", ["--log-level debug", "--context-length 4096",
                                   OVERRIDE.format('{"rope_theta": 5e5}')],
                         ids=["log_level", "shorter_context", "rope_theta_not_read"])
def test_a_setting_that_builds_the_same_draft_is_no_problem(flags, tmp_path):
    """What does not change the draft SGLang builds: a log level, a context shorter than its positions, and
    a config key its model does not read (SGLang's Llama layer takes rope_theta from rope_parameters,
    models/llama.py LlamaDecoderLayer; the override sets only the top-level key): a note says so."""
    result = settings(tmp_path, f"{CHAIN} {flags}")
    assert result.problems == [], [f"{p.key}: {p.what}" for p in result.problems]
    if "rope_theta" in flags:
        assert [k for k, _ in result.notes] == ["json_model_override_args"], result.notes
        assert "rope_theta: (not given) -> 500000.0" in result.notes[0][1], result.notes


@pytest.mark.meta
def test_a_setting_no_code_here_names_is_found_when_sglang_builds_the_draft_with_it(tmp_path, monkeypatch):
    """Planted: SGLang's ModelConfig.from_server_args made to read --log-level for the draft (as a release
    could start reading any flag). The check names no flags: it finds what the draft's build reads."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.configs.model_config import ModelConfig

    original = ModelConfig.from_server_args

    def planted(server_args, *args, is_draft_model=False, **kwargs):
        config = original(server_args, *args, is_draft_model=is_draft_model, **kwargs)
        if is_draft_model and resolving_view(server_args).log_level == "debug":
            config.hf_config.rms_norm_eps = 0.01
        return config

    monkeypatch.setattr(ModelConfig, "from_server_args", staticmethod(planted))
    result = settings(tmp_path, f"{CHAIN} --log-level debug")
    assert [p.key for p in result.problems] == ["settings:log_level"], [p.what for p in result.problems]
    problem = result.problems[0]
    assert "(rms_norm_eps)" in problem.what, problem.what
    assert all(f"{k}: 1e-06 -> 0.01" in problem.evidence for k in ("rms_norm_eps", "variance_epsilon")), \
        problem.evidence
    assert problem.where == "server setting: log_level (from --log-level)", problem.where
    assert problem.fix == "drop --log-level", problem.fix
