"""Wiring on the user's own files (conformance/user/wiring.py): SGLang's resolution of a draft
config and its capture on a tiny twin of a real target config, against the trainer's layers, slot by slot.

The seed (Kimi-K2.5, 61 layers: trained on [embed, 3, 31], served [3, 31, 59]) must be one problem naming
every slot, and the rewired draft none; on every shipped target config a draft wired as SGLang's default
is clean and one wired a layer off is reported; the hidden-state dump is checked against the target.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conformance.adapters.sglang.target import AuxIds
from conformance.user.trainer import Trainer, default_ids
from conformance.user.wiring import (
    boundary_name, build_twin, check_hidden_states, check_user_wiring, name_chunk, source_ref,
)
from fixtures.checkpoint import sglang_config_json, speculators_config_json
from fixtures.real_configs import REAL_CONFIGS, file_id, target_config_files
from conformance.wiring.target_twin import target_twin
from fixtures.tiny import make_config

pytestmark = pytest.mark.cpu
KIMI = REAL_CONFIGS / "target" / "moonshotai--Kimi-K2.5.json"
UNSUPPORTED = {"meta-llama--Llama-4-Scout-17B-16E-Instruct.json"}   # SGLang's mllama4: no twin here
SUPPORTED = [p for p in target_config_files() if p.name not in UNSUPPORTED]


def draft_dir(path: Path, eagle_ids: list[int] | None, fmt: str = "sglang") -> Path:
    """A draft directory holding only the config.json SGLang's resolution reads."""
    cfg = make_config(hidden_size=40, target_hidden_size=40)
    raw = speculators_config_json(cfg) if fmt == "speculators" else sglang_config_json(cfg)
    raw.pop("eagle_config", None)
    if eagle_ids is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_ids, "use_aux_hidden_state": True}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def speculators_trainer(ids) -> Trainer:
    return Trainer("speculators", "stated by --trainer", None if ids is None else tuple(ids),
                   "eagle_aux_hidden_state_layer_ids", None)


def test_kimi_seed_is_reported_slot_by_slot(tmp_path):
    """The bug that started the project, from the real files: one problem, both layer lists, each slot,
    the cause in SGLang's DeepSeek class and a fix; the draft rewired to that fix is clean."""
    trainer = speculators_trainer((0, 3, 31))
    shipped = check_user_wiring(draft_dir(tmp_path / "shipped", [3, 31, 59]), KIMI, trainer, tmp_path / "twins")
    text = "\n".join(shipped.lines())
    assert [p.key for p in shipped.problems] == ["wiring:aux-layers"], f"expected one wiring problem:\n{text}"
    problem = shipped.problems[0]
    assert "training: [embed, 3, 31]  serving: [3, 31, 59]" in problem.what, problem.what
    for slot, (t, s) in enumerate((("embed", "3"), ("3", "31"), ("31", "59"))):
        assert f"slot {slot}: training {t}, serving {s}  <- differs" in problem.evidence, problem.evidence
        assert f"slot {slot}: training {t}, serving {s}" in problem.where, problem.where
    assert "deepseek_v2.py:" in problem.cause and "kimi_k25.py:" in problem.cause, problem.cause
    assert "[0, 3, 31]" in problem.fix, problem.fix
    rewired = check_user_wiring(draft_dir(tmp_path / "rewired", [0, 3, 31]), KIMI, trainer, tmp_path / "twins")
    assert rewired.ok, "the rewired seed draft is reported:\n" + "\n".join(rewired.lines())
    assert rewired.serving == ("embed", "3", "31"), rewired.lists()


@pytest.mark.parametrize("target", SUPPORTED, ids=file_id)
def test_default_wiring_is_clean_and_one_layer_off_is_reported(target, tmp_path):
    """No eagle_config: SGLang's class default [2, N//2, N-3] is what speculators trains on by default.
    The same boundaries written verbatim as eagle_config ids are reported on classes that add 1 (the
    input-of-layer ids read as output-of-layer ones), slot by slot, one layer deeper."""
    n = target_twin(target).num_layers
    trainer = speculators_trainer(None)
    clean = check_user_wiring(draft_dir(tmp_path / "default", None), target, trainer, tmp_path / "twins")
    assert clean.ok, f"{target.name}: default wiring reported:\n" + "\n".join(clean.lines())
    trained = default_ids(n)
    off = check_user_wiring(draft_dir(tmp_path / "verbatim", [b for b in trained]), target, trainer, tmp_path / "twins")
    if off.layers_to_capture == trained:
        assert off.ok, "\n".join(off.lines())      # this class reads the ids as boundaries (DeepSeek, first id not 1)
        return
    assert [p.key for p in off.problems] == ["wiring:aux-layers"], "\n".join(off.lines())
    for slot, b in enumerate(trained):
        line = f"slot {slot}: training {boundary_name(b, n)}, serving {boundary_name(b + 1, n)}  <- differs"
        assert line in off.problems[0].evidence, off.problems[0].evidence
    assert str([b - 1 for b in trained]) in off.problems[0].fix, off.problems[0].fix


def test_chunks_are_named_by_their_boundary_and_a_perturbed_one_is_not(tmp_path):
    """The naming the slots rest on: every boundary of a 61-layer twin names itself, and a state moved by
    1e-3 (far below the distance between layers) names none."""
    run = build_twin(target_twin(KIMI), tmp_path)
    n = run.twin.num_layers
    for b, state in enumerate(run.states):
        assert name_chunk(run, state)[0] == boundary_name(b, n), f"boundary {b} not named as itself"
    moved = run.states[31].clone()
    moved[3, 5] += 1e-3
    assert name_chunk(run, moved)[0] == "?", "a perturbed chunk was named as a layer"
    layers, aux = run.capture(AuxIds(True, (0, 3, 31)))
    assert layers == (0, 3, 31) and aux is not None and aux.shape == (run.states[0].shape[0], 3 * 40)


def test_unsupported_target_and_unreadable_draft_config_are_problems(tmp_path):
    scout = REAL_CONFIGS / "target" / "meta-llama--Llama-4-Scout-17B-16E-Instruct.json"
    wiring = check_user_wiring(draft_dir(tmp_path / "d", None), scout, speculators_trainer(None), tmp_path / "t")
    assert [p.key for p in wiring.problems] == ["wiring:no-twin"], wiring.problems
    assert "Llama4ForConditionalGeneration" in wiring.problems[0].evidence, wiring.problems[0].evidence
    refused = check_user_wiring(draft_dir(tmp_path / "spec", None, fmt="speculators"), KIMI,
                                speculators_trainer(None), tmp_path / "t")
    assert [p.key for p in refused.problems] == ["wiring:config-refused"], refused.problems
    assert "model_type" in refused.problems[0].evidence, refused.problems[0].evidence


def test_causes_name_real_lines_of_the_installed_sglang():
    """A cause's file:line range is the function it names, in the installed package."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    ref = source_ref(DeepseekV2ForCausalLM.set_eagle3_layers_to_capture)
    path, lines = ref.split(":")
    start = int(lines.split("-")[0])
    import sglang

    text = (Path(sglang.__file__).parent.parent / path).read_text().splitlines()
    assert "def set_eagle3_layers_to_capture" in text[start - 1], (ref, text[start - 1])


def _dump(directory: Path, shape: tuple[int, ...]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": torch.zeros(shape), "token_ids": torch.zeros(shape[0], dtype=torch.long)},
              str(directory / "hs_0.safetensors"))
    return directory


def test_hidden_state_dump_is_checked_against_the_target(tmp_path):
    """Kimi-K2.5 is 7168 wide and SGLang feeds 3 aux slots: [L, 4, 7168] passes; another width or another
    number of layers is a problem naming the file."""
    wiring = check_user_wiring(draft_dir(tmp_path / "d", [0, 3, 31]), KIMI, speculators_trainer((0, 3, 31)),
                               tmp_path / "twins")
    assert check_hidden_states(_dump(tmp_path / "good", (5, 4, 7168)), KIMI, wiring) == []
    narrow = check_hidden_states(_dump(tmp_path / "narrow", (5, 4, 4096)), KIMI, wiring)
    assert [p.key for p in narrow] == ["wiring:dump-width"] and "4096" in narrow[0].evidence, narrow
    more = check_hidden_states(_dump(tmp_path / "more", (5, 5, 7168)), KIMI, wiring)
    assert [p.key for p in more] == ["wiring:dump-layers"] and "hs_0.safetensors" in more[0].where, more


OTHER_SERVERS = ["vllm"]   # servers other than SGLang whose adapters read the target wiring
LLAMA = REAL_CONFIGS / "target" / "meta-llama--Meta-Llama-3.1-8B.json"


@pytest.mark.parametrize("impl", OTHER_SERVERS)   # its own lane (make vllm)
def test_another_server_wiring_names_each_runner_and_its_fix(impl, tmp_path):
    """--serve-with vllm: an SGLang-format draft (trained on [1, 4, 8], ids [0, 3, 7] in eagle_config, as SGLang
    wants them) on Llama-3.1-8B is one problem per model runner: V2 reads no ids (the target's default), V1 reads
    them as input-of-layer ids (one layer shallower); each problem's fix, the top-level ids, serves it as trained
    on both runners, and SGLang's reading is unchanged by it (it ignores top-level ids in its own format)."""
    from conformance.wiring.cases import runners
    from conformance.user.wiring import check_server_wiring

    trainer = speculators_trainer((1, 4, 8))
    shipped = draft_dir(tmp_path / "shipped", [0, 3, 7])
    seen = {runner: check_server_wiring(impl, runner, shipped, LLAMA, trainer, tmp_path / "twins")[0]
            for runner in runners(impl)}
    assert seen["v2"].serving == ("2", "16", "29") and seen["v1"].serving == ("embed", "3", "7"), (
        {r: w.lines() for r, w in seen.items()})
    for runner, wiring in seen.items():
        assert [p.key for p in wiring.problems] == [f"wiring:{impl}:{runner}"], wiring.lines()
        assert "[1, 4, 8]" in wiring.problems[0].fix and "eagle3_utils.py" in seen["v2"].problems[0].cause
    fixed = draft_dir(tmp_path / "fixed", [0, 3, 7])
    raw = json.loads((fixed / "config.json").read_text())
    (fixed / "config.json").write_text(json.dumps({**raw, "eagle_aux_hidden_state_layer_ids": [1, 4, 8]}))
    for runner in runners(impl):
        wiring, served = check_server_wiring(impl, runner, fixed, LLAMA, trainer, tmp_path / "twins")
        assert wiring.ok and served["observed"], wiring.lines()
    assert check_user_wiring(fixed, LLAMA, trainer, tmp_path / "twins").ok
