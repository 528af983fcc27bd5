"""Bad input: every malformed draft, training file, dump or target config gets one line naming the file
and the field, the files stay byte-identical, and through `pytest --draft-checkpoint` it is a usage
error (exit code 4), distinct from a divergence found (exit code 1).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from conformance.user.user_draft import configure_user_inputs, input_files, validate_inputs
from conformance.checkpoints import sha256
from conformance.user.example_draft import write_example
from conformance.checkpoints import CheckpointError

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Bad:
    id: str
    edit: Callable[[Path, Path, Path, Path], None]   # (draft dir, jsonl, dump dir, target config) -> None
    file: str                                        # the file (or directory) the message must name
    words: str                                       # the field and problem it must state


def weights(d: Path) -> dict:
    return load_file(str(d / "model.safetensors"))


def save(d: Path, w: dict) -> None:
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


def edit_weights(fn):
    def edit(d, *_):
        w = weights(d)
        fn(w)
        save(d, w)
    return edit


def edit_config(fn):
    def edit(d, *_):
        raw = json.loads((d / "config.json").read_text())
        fn(raw)
        (d / "config.json").write_text(json.dumps(raw))
    return edit


def edit_jsonl(fn):
    def edit(d, data, *_):
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        fn(rows)
        data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return edit


def set_nan(w):
    w["fc.weight"][3, 5] = float("nan")


def truncate(d, *_):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def no_config(d, *_):
    (d / "config.json").unlink()


# The example draft is in SGLang's format (layers.* names, eagle_config ids) with fc_norm on.
BAD = [
    Bad("truncated_safetensors", truncate, "model.safetensors", "file: not a readable safetensors file"),
    Bad("empty_safetensors", lambda d, *_: (d / "model.safetensors").write_bytes(b""), "model.safetensors",
        "file: empty file"),
    Bad("missing_tensor", edit_weights(lambda w: w.pop("layers.0.hidden_norm.weight")), "model.safetensors",
        "tensor layers.0.hidden_norm.weight: missing (needed because every EAGLE-3 draft)"),
    Bad("missing_fc_norm", edit_weights(lambda w: w.pop("fc_norm.1.weight")), "model.safetensors",
        "tensor fc_norm.1.weight: missing (needed because fc_norm is true)"),
    Bad("extra_tensor", edit_weights(lambda w: w.update({"layers.0.self_attn.q_norm.weight": torch.ones(12)})),
        "model.safetensors", "tensor layers.0.self_attn.q_norm.weight: extra tensor"),
    Bad("duplicate_tensor",
        edit_weights(lambda w: w.update({"midlayer.hidden_norm.weight": w["layers.0.hidden_norm.weight"].clone()})),
        "model.safetensors", "duplicates layers.0.hidden_norm.weight"),
    Bad("wrong_shape", edit_weights(lambda w: w.update({"fc.weight": w["fc.weight"].T.contiguous()})),
        "model.safetensors", "tensor fc.weight: shape (120, 40), expected (40, 120)"),
    Bad("wrong_dtype", edit_weights(lambda w: w.update({"norm.weight": torch.ones(40, dtype=torch.int32)})),
        "model.safetensors", "tensor norm.weight: dtype int32, expected a float dtype"),
    Bad("d2t_dtype", edit_weights(lambda w: w.update({"d2t": w["d2t"].int()})), "model.safetensors",
        "tensor d2t: dtype int32, expected int64"),
    Bad("nan_weight", edit_weights(set_nan), "model.safetensors", "tensor fc.weight: nan at index (3, 5)"),
    Bad("inf_weight", edit_weights(lambda w: w["lm_head.weight"].__setitem__((0, 0), float("inf"))),
        "model.safetensors", "tensor lm_head.weight: inf at index (0, 0)"),
    Bad("d2t_all_zero", edit_weights(lambda w: w.update({"d2t": torch.zeros_like(w["d2t"])})), "model.safetensors",
        "tensor d2t: all zero with draft_vocab_size < vocab_size"),
    Bad("t2d_disagrees", edit_weights(lambda w: w.update({"t2d": w["t2d"].roll(1)})), "model.safetensors",
        "tensor t2d: disagrees with d2t"),
    Bad("d2t_missing", edit_weights(lambda w: w.pop("d2t")), "model.safetensors",
        "tensor d2t: missing (needed because draft_vocab_size 61 < vocab_size 97)"),
    Bad("unknown_architecture", edit_config(lambda c: c.update(architectures=["GPT2LMHeadModel"])), "config.json",
        "field architectures: GPT2LMHeadModel is not an EAGLE-3 draft"),
    Bad("missing_config_field", edit_config(lambda c: c.pop("hidden_size")), "config.json",
        "missing field hidden_size: required"),
    Bad("wrong_field_type", edit_config(lambda c: c.update(num_attention_heads="4")), "config.json",
        "field num_attention_heads: expected an integer >= 1, got '4'"),
    Bad("contradictory_norms", edit_config(lambda c: c.update(norm_before_fc=True)), "config.json",
        "field fc_norm: contradicts norm_before_fc"),
    # With its own lm_head.weight the same config is valid: two readings, a verdict problem (test_verdict.py).
    Bad("tie_without_a_head", lambda d, *_: (edit_config(lambda c: c.update(tie_word_embeddings=True))(d),
                                             edit_weights(lambda w: w.pop("lm_head.weight"))(d)),
        "model.safetensors", "tensor lm_head.weight: missing (needed because tie_word_embeddings is true with "
                             "draft_vocab_size 61 != vocab_size 97"),
    Bad("contradictory_aux_count", edit_config(lambda c: c.update(num_aux_hidden_states=4)), "config.json",
        "field num_aux_hidden_states: 4 contradicts the 3 aux layer ids"),
    Bad("unsupported_rope", edit_config(lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 1.0})),
        "config.json", "field rope_scaling.rope_type: longrope RoPE is not implemented"),
    Bad("odd_rotary_dim", edit_config(lambda c: c.update(partial_rotary_factor=0.25)), "config.json",
        "field partial_rotary_factor: 0.25 of head_dim 12 rotates 3 channels: expected an even number"),
    Bad("qwen3_without_qk_norm", edit_config(lambda c: c.update(model_type="qwen3")), "model.safetensors",
        "tensor layers.0.self_attn.q_norm.weight: missing (needed because draft_arch is qwen3"),
    Bad("rope_missing_field", edit_config(lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
        "config.json", "missing field rope_scaling.low_freq_factor"),
    Bad("empty_config", lambda d, *_: (d / "config.json").write_text(""), "config.json", "file: empty file"),
    Bad("config_not_json", lambda d, *_: (d / "config.json").write_text("{'hidden_size': 40}"), "config.json",
        "line 1: not valid JSON"),
    Bad("no_config_json", no_config, "draft", "config.json: missing: not a draft checkpoint directory"),
    Bad("no_weights", lambda d, *_: (d / "model.safetensors").unlink(), "draft",
        "model.safetensors: missing (no model.safetensors"),
    Bad("jsonl_wrong_keys", edit_jsonl(lambda r: r[0].update(token_ids=r[0].pop("input_ids"))), "train.jsonl",
        "line 1: missing field input_ids (found: loss_mask, seq_len"),
    Bad("jsonl_malformed_line", lambda d, data, *_: data.write_text(data.read_text() + '{"input_ids": [1,\n'),
        "train.jsonl", "line 4: not valid JSON"),
    Bad("jsonl_inconsistent_lengths", edit_jsonl(lambda r: r[1].update(seq_len=r[1]["seq_len"] + 1)), "train.jsonl",
        "line 2: seq_len: 7, but input_ids has 6 tokens"),
    Bad("jsonl_id_out_of_vocab", edit_jsonl(lambda r: r[2]["input_ids"].__setitem__(0, 500)), "train.jsonl",
        "line 3: input_ids: token id 500 >= the draft's vocab_size 97"),
    Bad("jsonl_empty", lambda d, data, *_: data.write_text(""), "train.jsonl", "file: empty file (no samples)"),
    Bad("dump_wrong_shape", lambda d, data, dump, _: save_file(
        {"hidden_states": torch.zeros(10, 3, 40), "token_ids": load_file(str(dump / "hs_0.safetensors"))["token_ids"]},
        str(dump / "hs_0.safetensors")), "hs_0.safetensors",
        "tensor hidden_states: shape (10, 3, 40), expected (10, 4, 40)"),
    Bad("dump_wrong_tokens", lambda d, data, dump, _: save_file(
        {"hidden_states": load_file(str(dump / "hs_1.safetensors"))["hidden_states"],
         "token_ids": torch.zeros(6, dtype=torch.int64)},
        str(dump / "hs_1.safetensors")), "hs_1.safetensors", "tensor token_ids: differs from input_ids of line 2"),
    Bad("target_config_missing_field",
        lambda d, data, dump, target: target.write_text(json.dumps({"model_type": "llama"})),
        "target.json", "missing field hidden_size"),
]


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("example")
    write_example(root, "sglang")
    (root / "target.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "hidden_size": 40, "num_hidden_layers": 8, "vocab_size": 97}))
    return root


@pytest.fixture
def inputs(example, tmp_path):
    """A fresh copy of the valid example inputs: (draft dir, jsonl, dump dir, target config)."""
    shutil.copytree(example, tmp_path, dirs_exist_ok=True)
    return tmp_path / "draft", tmp_path / "train.jsonl", tmp_path / "hidden_states", tmp_path / "target.json"


def test_the_example_inputs_are_valid(inputs):
    validated = validate_inputs(*inputs)
    assert validated.checkpoint.format == "sglang" and len(validated.samples) == 3


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.id)
def test_bad_input_is_one_line_naming_file_and_field(bad, inputs):
    bad.edit(*inputs)
    before = {p: sha256(p) for p in input_files(*inputs)}
    with pytest.raises(CheckpointError) as info:
        validate_inputs(*inputs)
    message = str(info.value)
    assert "\n" not in message, f"not one line:\n{message}"
    named = message.split(": ", 1)[0]
    assert Path(named).name == bad.file, f"names {named}, expected the file {bad.file}: {message}"
    assert bad.words in message, f"expected {bad.words!r} in: {message}"
    assert before == {p: sha256(p) for p in input_files(*inputs)}, "validation changed an input file"


def test_at_least_twenty_malformed_inputs():
    assert len(BAD) >= 20 and len({b.id for b in BAD}) == len(BAD)


# ---------------------------------------------------------------- through pytest itself

def run_pytest(*args: str, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("bad", [b for b in BAD if b.id in ("truncated_safetensors", "unknown_architecture",
                                                            "jsonl_wrong_keys")], ids=lambda b: b.id)
def test_bad_input_is_a_usage_error_of_pytest(bad, inputs):
    """Exit code 4 (usage error), one line on the terminal, before any test runs."""
    draft, data, dump, target = inputs
    bad.edit(*inputs)
    before = {p: sha256(p) for p in input_files(*inputs)}
    result = run_pytest("--draft-checkpoint", str(draft), "--training-data", str(data), "--hidden-states", str(dump),
                        "--target-config", str(target), "conformance/user/test_user_draft.py")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 4, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert len(lines) == 1 and lines[0].startswith("ERROR: ") and bad.words in lines[0], lines
    assert before == {p: sha256(p) for p in input_files(*inputs)}


class Options:
    """The two members of pytest's config that configure_user_inputs reads."""

    def __init__(self, **options):
        self.options, self.stash = options, pytest.Stash()

    def getoption(self, name):
        return self.options.get(name)


def test_training_data_without_a_checkpoint_is_a_usage_error(inputs):
    with pytest.raises(pytest.UsageError, match="--training-data needs --draft-checkpoint"):
        configure_user_inputs(Options(**{"--training-data": str(inputs[1])}))


def test_bad_input_raises_the_usage_error_pytest_exits_4_on(inputs):
    draft = inputs[0]
    (draft / "config.json").write_text("")
    with pytest.raises(pytest.UsageError, match="config.json: file: empty file"):
        configure_user_inputs(Options(**{"--draft-checkpoint": str(draft)}))
