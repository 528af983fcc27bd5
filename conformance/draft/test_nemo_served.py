"""NeMo Automodel 0.7.0's checkpoints through every server (each adapter with `is_server`; one in its own lane,
e.g. vLLM's, runs there).

As written, each server refuses a NeMo directory: it resolves the draft's class by the name NeMo writes, which
neither it nor transformers registers (the registry's reading entries for the nemo format, each a strict xfail where
its loader refuses). This module checks that and the two ways a NeMo user gets it served:
- this suite's conversion (conformance/user/convert.py, run as a user runs it, into the server's own format): the
  same tensors bit for bit, the config the server's own format writes, the server's weight accounting, step 0 and
  K = 7 steps against the reference, each judged against the registry as the built-in matrix judges that format;
- NeMo's own serving helper for SGLang (components/speculative/serve_sglang.py resolve_draft_artifacts), which rewrites
  only `architectures` in a consolidated directory and keeps the target's depth as num_hidden_layers.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS, DEFAULT_SERVER, account
from conformance.checkpoints import CONFIG_FILE, open_checkpoint, read_weights
from conformance.checkpoints.formats import nemo
from conformance.core.common import first_line
from conformance.core.matching import known_param, match_load, settle, settle_accounting
from conformance.core.registry import applicable, case_names, for_accounting
from conformance.core.compare import compare_traces
from conformance.core.sections import Section
from conformance.core.tolerances import DTYPES
from conformance.session.harness import DraftStore, assert_conforms, conformance_params
from conformance.user import convert
from fixtures.cases import MULTISTEP_CASES, STEP0_CASES

pytestmark = pytest.mark.cpu
SERVER = DEFAULT_SERVER   # NeMo's own serving helper is for SGLang, the default server
SERVERS = [impl for impl in ALL_IMPLEMENTATIONS if ADAPTERS[impl].is_server]
STEPS = 7
# NeMo's Llama drafts and its MLA drafts (DeepseekV3Eagle3DraftModel: the mla_* cases NeMo can train), each served
# from the format the server serves that draft from (its adapter's format_for: SGLang's MLA class has its own).
STEP0 = [c for c in STEP0_CASES if not nemo.inexpressible(c.config)]
MULTISTEP = [c for c in MULTISTEP_CASES if not nemo.inexpressible(c.config)]


class ConvertedStore(DraftStore):
    """The built-in cases, each server loading each case's NeMo directory as this suite's converter turns it into
    the server's own format (`python -m conformance.user.convert DRAFT OUT --format FORMAT`)."""

    def directory(self, impl: str, case) -> Path:
        if impl not in SERVERS:
            return super().directory(impl, case)
        fmt = ADAPTERS[impl]().format_for(case.config)
        out = self.root / case.id / f"nemo-converted-{fmt}"
        if not out.exists():
            code = convert.main([str(self.checkpoint(case)[nemo.NAME]), str(out), "--format", fmt])
            assert code == 0, f"the converter refused {case.id}'s NeMo directory (exit {code})"
        return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return ConvertedStore(tmp_path_factory.mktemp("nemo-served"))


def as_written(impl: str, case) -> tuple:
    """The registry's readings of the nemo format by the server that apply to the case: its loader's refusal."""
    names = {**case_names(case), "format": nemo.NAME, "absent": (), "overruled": ()}
    return tuple(dataclasses.replace(e, area="load") for e in applicable("reading", impl, names) if e.error)


@pytest.mark.parametrize("impl,case", [known_param(i, c, id=f"{i}-{c.id}", known=as_written(i, c))
                                       for i in SERVERS for c in STEP0])
def test_server_reads_the_nemo_directory_as_written(impl, case, drafts, repro):
    """The directory as NeMo's checkpointer writes it, loaded by the server's own path (its class resolved from
    architectures as its model runner resolves it) and run at step 0 against the reference."""
    try:
        loaded = ADAPTERS[impl]().load(drafts.checkpoint(case)[nemo.NAME], torch.float32)
    except Exception as exc:   # the server's loader refused the directory: its own words, one line
        settle(f"{impl} could not load {case.id}'s NeMo directory: {type(exc).__name__}: {first_line(exc)}\n"
               f"  repro: {repro}", match_load(as_written(impl, case), type(exc).__name__, first_line(exc)))
    actual = loaded.run(drafts.batch(case), 1).on_cpu()
    first = compare_traces(actual, drafts.trace("reference", case, torch.float32), case.id).first_divergence
    assert first is None, f"{impl} serves {case.id}'s NeMo directory differently: first divergence {first}"


@pytest.mark.parametrize("impl,case", [(i, c) for i in SERVERS for c in STEP0], ids=lambda p: getattr(p, "id", p))
def test_conversion_keeps_every_tensor_and_writes_the_servers_format(impl, case, converted):
    """The converted directory holds NeMo's tensors bit for bit under the server's names, and the config.json the
    server's own format writes for the case (the ids NeMo's default gives its target depth)."""
    out = converted.directory(impl, case)
    own = converted.checkpoint(case)[ADAPTERS[impl]().format_for(case.config)]
    assert json.loads((out / CONFIG_FILE).read_text()) == json.loads((own / CONFIG_FILE).read_text())
    got, want = read_weights(out), read_weights(converted.checkpoint(case)[nemo.NAME])
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"the conversion changed {differ}"
    assert open_checkpoint(out).config == case.config


@pytest.mark.parametrize("impl,case", [known_param(i, c, id=f"{i}-{c.id}", known=for_accounting(i, c))
                                       for i in SERVERS for c in STEP0])
def test_converted_nemo_draft_weight_accounting(impl, case, converted, report, repro):
    acct = account(impl, converted.directory(impl, case))
    report.add_row(Section.WEIGHT_ACCOUNTING, acct.row(f"{case.id} (NeMo, converted)"))
    assert acct.tensors == len(read_weights(converted.checkpoint(case)[nemo.NAME]))
    settle_accounting(acct, for_accounting(impl, case), f"{impl} weight accounting [{case.id}, NeMo converted]",
                      repro)


@pytest.mark.parametrize("impl,dtype_name,case",
                         list(conformance_params(SERVERS, DTYPES, STEP0, extra_id="nemo-converted", steps=1)))
def test_converted_nemo_draft_step0_matches_reference(impl, dtype_name, case, converted, report, request, repro):
    assert_conforms(converted, report, impl, case, dtype_name, request.node.nodeid, repro)


@pytest.mark.parametrize("impl,dtype_name,case",
                         list(conformance_params(SERVERS, DTYPES, MULTISTEP, extra_id="nemo-converted")))
def test_converted_nemo_draft_multistep_matches_reference(impl, dtype_name, case, converted, report, request, repro):
    assert_conforms(converted, report, impl, case, dtype_name, request.node.nodeid, repro, steps=STEPS)


def test_nemos_own_serving_export_keeps_the_targets_depth(drafts, tmp_path):
    """NeMo's serve_sglang.py rewrites a consolidated directory's architectures for SGLang (:321) but not its
    num_hidden_layers (only the legacy draft_model.pt export does, :274-275): SGLang then builds the target's depth
    of draft layers (llama_eagle3.py:198-204) and loads layer 0 alone; every parameter of the others keeps
    SGLang's uninitialised memory. Observed on a copy of a NeMo directory, with NeMo's own function."""
    from nemo_automodel.components.speculative.serve_sglang import resolve_draft_artifacts

    case = STEP0[0]
    copy = shutil.copytree(drafts.checkpoint(case)[nemo.NAME], tmp_path / "consolidated")
    served, _ = resolve_draft_artifacts(str(copy), "EAGLE3")
    config = json.loads((copy / CONFIG_FILE).read_text())
    depth = nemo.target_depth(case.config)
    assert served == str(copy) and config["architectures"] == ["LlamaForCausalLMEagle3"], config["architectures"]
    assert config["num_hidden_layers"] == depth > 1, "NeMo's export now writes the draft's depth"
    acct = account(SERVER, copy)
    later = {p for p in ADAPTERS[SERVER]().load(copy, torch.float32).model.state_dict()
             if p.startswith("model.layers.") and p.split(".")[2] != "0"}
    assert later and set(acct.never_loaded) == later, (sorted(later ^ set(acct.never_loaded)), acct.row(case.id))
    assert not acct.dropped and len(acct.landed) == acct.tensors - len(acct.ignored)


def test_nemos_own_serving_export_gives_an_mla_draft_sglangs_llama_class(drafts, tmp_path):
    """NeMo's serve_sglang names SGLang's Llama draft class for every EAGLE-3 draft
    (`_SGLANG_ARCHITECTURE_FOR_ALGORITHM`, speculative/serve_sglang.py:93-95, written at :147-150), its MLA draft's
    too: SGLang then builds LlamaForCausalLMEagle3 from the DeepSeek-V3 config (a Llama attention, the target's depth
    of layers), and every MLA attention tensor but o_proj reaches nothing, without a word (llama_eagle3.py:363,
    373); the Llama attention's qkv_proj is never loaded. The user's check names it (SGLang would not build its MLA
    draft: the directory's problem) and the converter's default turns NeMo's saved directory into SGLang's MLA class
    instead, every tensor landing. Observed on a copy, with NeMo's own function."""
    from nemo_automodel.components.speculative.serve_sglang import resolve_draft_artifacts

    from conformance.checkpoints.formats import sglang_mla
    from conformance.user.servable import directory_problem

    case = next(c for c in STEP0 if c.config.draft_arch == "mla" and c.config.q_lora_rank is not None)
    saved = drafts.checkpoint(case)[nemo.NAME]
    copy = shutil.copytree(saved, tmp_path / "consolidated")
    resolve_draft_artifacts(str(copy), "EAGLE3")
    assert json.loads((copy / CONFIG_FILE).read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    acct = account(SERVER, copy)
    attention = {n for n in read_weights(copy, stored_names=True) if ".self_attn." in n}
    assert set(acct.dropped) == {n for n in attention if ".o_proj." not in n}, acct.row(case.id)
    assert "model.layers.0.self_attn.qkv_proj.weight" in acct.never_loaded, acct.row(case.id)
    problem = directory_problem(copy, "nemo-sglang", copy.name, mla=True)
    assert problem is not None and "LlamaForCausalLMEagle3" in problem.evidence, problem

    out = tmp_path / "converted"
    assert convert.main([str(saved), str(out)]) == 0   # no --format: SGLang's MLA format for an MLA draft
    assert json.loads((out / CONFIG_FILE).read_text())["architectures"] == [sglang_mla.ARCHITECTURE]
    converted_acct = account(SERVER, out)
    assert not converted_acct.problems and len(converted_acct.landed) + len(converted_acct.ignored) == \
        converted_acct.tensors == len(read_weights(saved)), converted_acct.row(case.id)
    assert directory_problem(out, sglang_mla.NAME, out.name, mla=True) is None
