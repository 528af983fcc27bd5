"""The verdict on a user's MLA draft (DeepSeek's latent attention: SGLang's `Eagle3DeepseekV2ForCausalLM`, the drafts
Kimi-K2.5/K2.6 are served with), as a user gets it from `eagle3-conformance check` (the entry point, run from the
preloaded process as conformance/meta/test_verdict.py runs it).

The draft is fixtures/mla.py's: the published TorchSpec config (`lightseekorg/kimi-k2.5-eagle3-mla`) made tiny, in
either of TorchSpec's tensor layouts. On the real Kimi-K2.5 target config:
  - with a chain and the draft's own context length, every check that exists for it passes: exit 0, served as
    trained (the trainer is not stated, so it is judged against the reference; speculators cannot load an MLA draft
    and vLLM's is not built, and neither is asked: the verdict says whom it judged);
  - with the chain alone, SGLang refuses to start: Kimi-K2.5's context (262144) is longer than the draft's positions
    (DeepseekV3Config's default, the published config states none): exit 1, that one problem;
  - with norm_before_fc (an `input_norm.weight`), SGLang's MLA draft drops the norm at load and its forward has no
    input norm stage: exit 1, the two registered problems, each naming its file:line and the fix;
  - a malformed MLA config is bad input: exit 4, one line naming the file and the field;
  - a draft NeMo Automodel saved (its MLA draft, DeepseekV3Eagle3DraftModel, through its own checkpointer): the trainer
    is detected as NeMo, SGLang cannot read the directory as written (the one problem, with the conversion into
    SGLang's MLA format as its printed fix), and the conversion, checked, is served as trained.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from conformance.checkpoints import open_checkpoint
from conformance.checkpoints.errors import CheckpointError
from conformance.meta.planted_sglang import PLANT_ENV, PLUGIN
from conformance.meta.preloaded import Preloaded
from conformance.meta.test_verdict import (HEADLINE, KIMI, NO_XDIST, NOT_CHECKED, Printed, assert_fixes_fix,
                                          verdict_block)
from conformance.user.verdict import EXIT_BAD_INPUT, EXIT_NOT_SERVED, EXIT_SERVED, NOT_SERVED, SERVED
from fixtures.mla import ABSENT, LAYOUTS, make_mla_config, make_mla_weights, write_mla_checkpoint

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
SEED = 20261
CHAIN = "--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4"


def mla_draft(root: Path, layout: str = "layers.0", extra: dict | None = None, **changes) -> Path:
    cfg = make_mla_config(**changes)
    weights = make_mla_weights(make_mla_config(), torch.Generator().manual_seed(SEED), layout)
    weights.update(extra(cfg) if extra else {})
    return write_mla_checkpoint(root / "draft", cfg, weights)


def with_input_norm(cfg: dict) -> dict:
    return {"input_norm.weight": torch.linspace(0.5, 1.5, 3 * cfg["hidden_size"])}


@pytest.fixture(scope="module")
def preloaded(tmp_path_factory):
    process = Preloaded(tmp_path_factory.mktemp("preloaded"))
    yield process
    process.close()


def check(preloaded: Preloaded, draft: Path, *args: str, planted: str | None = None):
    """`eagle3-conformance check DRAFT ARGS` from an empty directory outside the draft's; (result, report dir).
    `planted`: a source_patcher config applied to SGLang in that run alone (conformance/meta/planted_sglang.py)."""
    report, cwd = draft.parent / "report", draft.parent / "cwd"
    cwd.mkdir()
    plant = PLUGIN if planted else ()
    result = preloaded.run([sys.executable, "-m", "conformance.cli", "check", str(draft), *args, "--report",
                            str(report), "--", *NO_XDIST, *plant], cwd=cwd,
                           env={PLANT_ENV: planted} if planted else None)
    return result, report


def headline(result) -> re.Match:
    m = HEADLINE.search(result.stdout)
    assert m, f"exit {result.returncode}, no verdict line:\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    return m


def verdict_json(report: Path) -> dict:
    return json.loads((report / "report.json").read_text())["verdict"]


# ---------------------------------------------------------------- the format: read, not refused

@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mla_draft_is_read_as_one(layout, tmp_path):
    ckpt = open_checkpoint(mla_draft(tmp_path, layout))
    cfg = ckpt.config
    assert (ckpt.format, cfg.draft_arch) == ("sglang-mla", "mla")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (make_mla_config()["q_lora_rank"], make_mla_config()["kv_lora_rank"])
    assert {n for n in ckpt.tensors if n.startswith("layers.0.self_attn.")} >= \
        {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"}


@pytest.mark.parametrize("changes,field", [
    (dict(kv_lora_rank=ABSENT), "field kv_lora_rank"),
    (dict(kv_lora_rank="16"), "field kv_lora_rank"),
    (dict(model_type="llama"), "field kv_lora_rank"),
    (dict(qk_rope_head_dim=-8), "field qk_rope_head_dim"),
], ids=["no_kv_lora_rank", "kv_lora_rank_a_string", "not_a_deepseek_model_type", "negative_rope_dim"])
def test_a_malformed_mla_config_names_its_field(changes, field, tmp_path):
    with pytest.raises(CheckpointError) as info:
        _ = open_checkpoint(mla_draft(tmp_path, **changes)).config
    assert f"config.json: {field}:" in str(info.value) and "\n" not in str(info.value), str(info.value)


# ---------------------------------------------------------------- the verdict, as the user runs it

def test_the_published_shape_is_served_as_trained_on_kimi(preloaded, tmp_path):
    """Every check that exists for an MLA draft ran and passed: SGLang's load, bit for bit; every stage its MLA
    column claims at step 0 and over 3 teacher-forced steps, fp32 and bf16; the target wiring on Kimi-K2.5's
    class; the server flags of a chain within the draft's positions. In TorchSpec's `--vllm` layout: the other
    (`midlayer.*`) is read as one above and lands bit for bit in SGLang (draft/test_mla_sglang.py); a whole
    verdict on it (12 s) would check the same again."""
    draft = mla_draft(tmp_path, "layers.0")
    positions = open_checkpoint(draft).config.max_position_embeddings
    result, report = check(preloaded, draft, f"--target-config={KIMI}", f"--sglang-args={CHAIN} --context-length "
                                                                         f"{positions}")
    assert result.returncode == EXIT_SERVED and headline(result)[1] == SERVED, verdict_block(result.stdout)
    verdict = verdict_json(report)
    assert not verdict["not_checked"] and verdict["checks"]["failed"] == 0, verdict
    ran = {c["nodeid"].rsplit("::", 1)[-1] for c in json.loads((report / "report.json").read_text())["comparisons"]
           if c["impl"] == "sglang" and c["outcome"] == "pass"}
    assert any(n.startswith("test_user_draft_step0") for n in ran) and \
        any(n.startswith("test_user_draft_multistep") for n in ran), ran
    assert "sglang-mla format" in verdict["draft"] and "judged against training semantics" in verdict["trainer"]
    wiring = json.loads((report / "report.json").read_text())["sections"]["wiring"]
    assert [row["outcome"] for row in wiring if row["Case"] == "user wiring"] == ["pass"], wiring


def test_a_server_context_past_the_drafts_positions_is_the_one_problem(preloaded, tmp_path):
    """The chain alone on Kimi-K2.5: the target's context is longer than the positions the draft states (none: its
    DeepseekV3Config default), which SGLang refuses to start with."""
    result, report = check(preloaded, mla_draft(tmp_path), f"--target-config={KIMI}", f"--sglang-args={CHAIN}")
    m = headline(result)
    assert result.returncode == EXIT_NOT_SERVED and m[2] == "1", verdict_block(result.stdout)
    problem, = verdict_json(report)["problems"]
    assert problem["where"] == "server flag: context_length", problem


def test_norm_before_fc_is_dropped_by_sglangs_mla_draft(preloaded, tmp_path):
    draft = mla_draft(tmp_path, norm_before_fc=True, extra=with_input_norm)
    positions = open_checkpoint(draft).config.max_position_embeddings
    result, report = check(preloaded, draft, f"--target-config={KIMI}",
                           f"--sglang-args={CHAIN} --context-length {positions}")
    m = headline(result)
    block = verdict_block(result.stdout)
    assert result.returncode == EXIT_NOT_SERVED and m[0].startswith(f"VERDICT: {NOT_SERVED}") and m[2] == "2", block
    for named in ("dropped silently: input_norm.weight", "kimi_k25_eagle3.py:494-496",
                  "retrain without it: norm_before_fc false", "stage `fc_in_norm`", "kimi_k25_eagle3.py:285-293"):
        assert named in block, (named, block)
    # the load's drop and the forward's missing norm, each its registered entry, one fix
    assert [p["registry_id"] for p in verdict_json(report)["problems"]] == [
        "sglang-mla-input-norm-dropped-at-load", "sglang-mla-input-norm-skipped"], verdict_json(report)["problems"]


# Planted in SGLang's DeepSeek MLP, the MLA draft layer's (models/deepseek_v2.py DeepseekV2MLP.forward): its gate/up
# projection's output scaled, so the MLP's output is the first stage that differs.
MLP_SCALED = """
patches:
  - target: sglang.srt.models.deepseek_v2.DeepseekV2MLP.forward
    edits:
      - match: |
          gate_up, _ = self.gate_up_proj(x)
        replacement: |
          gate_up, _ = self.gate_up_proj(x)
          gate_up = gate_up * 1.25
"""


def test_a_fault_outside_the_attention_is_named_at_its_stage(preloaded, tmp_path):
    """Planted in SGLang's MLA draft's MLP, in the user's run alone: the verdict names the MLP's output, step 0, in
    every forward check that ran (the user checks compare every stage SGLang's MLA column claims, not only the
    attention's and the logits)."""
    # No target: SGLang's DeepSeek target class, whose capture the wiring check runs, has the same MLP.
    result, report = check(preloaded, mla_draft(tmp_path), planted=MLP_SCALED)
    block = verdict_block(result.stdout)
    m = headline(result)
    assert result.returncode == EXIT_NOT_SERVED and m[0].startswith(f"VERDICT: {NOT_SERVED}") and m[2] == "1", block
    forward = [c for c in json.loads((report / "report.json").read_text())["comparisons"] if c["impl"] == "sglang"]
    assert forward and all(c["outcome"] != "pass" for c in forward), forward
    assert "draft step 0, stage `layers.0.mlp_out`" in block, block


@pytest.mark.parametrize("changes", [dict(kv_lora_rank=ABSENT), dict(kv_lora_rank="16")],
                         ids=["no_kv_lora_rank", "kv_lora_rank_a_string"])
def test_a_malformed_mla_draft_is_bad_input(changes, preloaded, tmp_path):
    result, _ = check(preloaded, mla_draft(tmp_path, **changes))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == EXIT_BAD_INPUT, f"exit {result.returncode}:\n{result.stdout[-3000:]}"
    assert len(lines) == 1 and "config.json: field kv_lora_rank:" in lines[0], lines


def test_a_trainer_that_cannot_load_an_mla_draft_is_not_checked(preloaded, tmp_path):
    """speculators has no MLA draft layer: its checks did not run, and the verdict says so and why, never passed."""
    result, report = check(preloaded, mla_draft(tmp_path), "--trainer=speculators")
    m = headline(result)
    assert result.returncode == NOT_CHECKED and m[3], verdict_block(result.stdout)
    unchecked = verdict_json(report)["not_checked"]
    assert any(u["what"].startswith("step0 matches reference [speculators") and "no MLA draft layer" in u["how"]
               for u in unchecked), unchecked


def test_q_without_lora_is_refused_by_sglangs_mla_draft(preloaded, tmp_path):
    """`q_lora_rank: null` (q_proj straight from the input, as training allows): SGLang's MLA layer refuses to build;
    one problem, in SGLang's words, with its file:line."""
    cfg = make_mla_config(q_lora_rank=None)
    draft = write_mla_checkpoint(tmp_path / "draft", cfg, make_mla_weights(cfg, torch.Generator().manual_seed(SEED)))
    result, _ = check(preloaded, draft)
    m = headline(result)
    block = verdict_block(result.stdout)
    assert result.returncode == EXIT_NOT_SERVED and m[2] == "1", block
    for named in ("cannot load this draft", "requires q_lora_rank", "kimi_k25_eagle3.py:113-117"):
        assert named in block, (named, block)


# ---------------------------------------------------------------- a draft NeMo Automodel saved

@pytest.mark.parametrize("prepared,fmt", [(None, "nemo"), ("sglang", "nemo-sglang")],
                         ids=["as_saved", "prepared_by_serve_sglang"])
def test_a_nemo_saved_mla_draft_is_converted_and_served_as_trained(prepared, fmt, preloaded, tmp_path):
    """NeMo Automodel 0.7.0's MLA draft as its checkpointer writes it (the example generator's write_as_trained: the
    NeMo adapter's save_checkpoint, NeMo's own Checkpointer.save_model): architectures LlamaEagle3DraftModel, the
    target's DeepseekV3Config and depth, `model.`-prefixed tensors in one shard; or that directory after NeMo's own
    SGLang helper (serve_sglang) renamed its class to SGLang's Llama draft's. SGLang cannot build its MLA draft from
    either as written (the first: no class, registry sglang-nemo-mla-format-architecture-unknown; the second: its
    Llama draft, which drops the MLA attention, conformance/draft/test_nemo_served.py); the printed fix converts it
    into SGLang's MLA format (the converter's default for an MLA draft), and the check it prints after that finds
    nothing left to fix."""
    from conformance.user.example_draft import prepare_as_trainer, write_as_trained
    from fixtures.cases import CASES_BY_ID
    from fixtures.tiny import make_draft_weights

    case = CASES_BY_ID["mla_q_lora"]   # what NeMo trains: q LoRA, interleaved plain rope (no yarn: registry nemo-mla-*)
    draft = write_as_trained(case.config, make_draft_weights(case.config, torch.Generator().manual_seed(SEED)),
                             tmp_path / "saved", "nemo")
    if prepared:
        draft = prepare_as_trainer(draft, "nemo", prepared)
    written = {p.name: p.read_bytes() for p in draft.iterdir()}
    assert open_checkpoint(draft).format == fmt
    result, report = check(preloaded, draft)
    block = verdict_block(result.stdout)
    m = headline(result)
    assert result.returncode == EXIT_NOT_SERVED and m[2] == "1", block
    verdict = verdict_json(report)
    assert verdict["trainer"].startswith("nemo (") and f"({fmt} format)" in verdict["draft"], verdict
    problem, = verdict["problems"]
    assert problem["where"] == f"config.json ({fmt} format)", problem
    assert "Eagle3DeepseekV2ForCausalLM" in problem["fix"], problem
    ran = {c["nodeid"].rsplit("::", 1)[-1]: c["outcome"] for c in
           json.loads((report / "report.json").read_text())["comparisons"] if c["impl"] == "sglang"}
    assert ran and set(ran.values()) == {"pass"}, ran   # SGLang's MLA draft on the conversion: every stage it claims
    assert {p.name: p.read_bytes() for p in draft.iterdir()} == written, "the check wrote into the user's draft"
    printed = Printed.of(result.stdout)
    assert printed.fixed == [1] and "conformance.user.convert" in printed.fixes[0], printed
    assert_fixes_fix(printed, lambda command: preloaded.run(shlex.split(command), cwd=tmp_path))
