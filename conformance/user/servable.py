"""Can SGLang read the user's directory as written, and does the conversion that makes it servable keep
the draft?

SGLang reads a draft's config.json with its own `get_config` (transformers' AutoConfig behind it) and
builds the class named by `architectures[0]`. A speculators-format config.json has no `model_type`,
so SGLang 0.5.23 refuses it; the original EAGLE-3 export names `LlamaForCausalLM`, a target class.
Such a directory is the verdict's first problem; its fix is this suite's converter, whose output
the rest of the run judges, and whose output is checked here: every tensor bit-exact, the aux ids
SGLang will capture, the norms and the vocabulary SGLang builds.
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch

from conformance.checkpoints.formats import sglang_mla
from conformance.checkpoints.knobs import CONFIG_FILE
from conformance.checkpoints.weights import read_weights
from conformance.core.common import first_line
from conformance.core.findings import CONVERSION, CONVERT, DIRECTORY, Problem

DRAFT_CLASS = "LlamaForCausalLMEagle3"    # the class SGLang serves an EAGLE-3 Llama draft with
# What the conversion must keep, as the loaded models report it (conformance/loading/accounting.py knobs).
KEPT_KNOBS = ("aux states x width", "norm_before_fc", "fc_norm", "norm_output", "vocab / draft vocab")


def sglang_config(path: Path):
    """SGLang's own config reader, minus its per-process cache (keyed by path only)."""
    from sglang.srt.utils.hf_transformers.config import get_config

    return get_config.__wrapped__(str(path), trust_remote_code=False)


def _site(filename: str, line: int) -> str:
    cut = filename.rfind("site-packages/")
    return f"{filename[cut + len('site-packages/'):] if cut >= 0 else Path(filename).name}:{line}"


def raise_site(exc: BaseException) -> str:
    """Where SGLang handed over and where it was raised: file:line in the installed packages."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/sglang/" in f.filename]
    last = frames[-1] if frames else None
    parts = [_site(f.filename, f.lineno) for f in (ours[-1] if ours else None, last) if f is not None]
    return " -> ".join(dict.fromkeys(parts)) or type(exc).__name__


def directory_problem(path: Path, fmt: str, shown: str, convert_args: str = "",
                      mla: bool = False) -> Problem | None:
    """None when SGLang reads `path` as the EAGLE-3 draft it is (`mla`: an MLA draft, SGLang's MLA class; else its
    Llama draft); else why not, with the conversion (`convert_args`: the converter's options for this run's target
    and training layers; the converter writes an MLA draft in SGLang's MLA format)."""
    from sglang.srt.utils.hf_transformers.mistral_utils import is_mistral_model

    served = sglang_mla.ARCHITECTURE if mla else DRAFT_CLASS
    ids = "for the target's class" if "--target-config" in convert_args else "in SGLang's eagle_config convention"
    fix = (f"convert it into {shown}-sglang beside it with this suite's converter (architectures {served}, "
           f"aux ids {ids}, every tensor unchanged: the command ends the verdict); the rest of this verdict judges "
           "that conversion")
    what, where = "SGLang cannot read this directory as written", f"{CONFIG_FILE} ({fmt} format)"
    try:
        config = sglang_config(path)
    except Exception as exc:   # SGLang's own reader: its words and where it raised
        evidence = f"{type(exc).__name__}: {first_line(exc)}".replace(str(path), shown)
        if is_mistral_model(path):
            fix = ("rename the directory: SGLang reads any path containing both 'eagle' and 'mistral' as a "
                   "Mistral params.json checkpoint (sglang/srt/utils/hf_transformers/mistral_utils.py:361-362)")
        return Problem(what, where, evidence, raise_site(exc), fix, DIRECTORY, key="directory",
                       remedy="" if is_mistral_model(path) else CONVERT)
    archs = list(getattr(config, "architectures", None) or [])
    # An MLA draft's own class (sglang-mla format) is SGLang's MLA EAGLE-3 draft (models/kimi_k25_eagle3.py).
    if not archs or archs[0] not in (served, *((sglang_mla.ARCHITECTURE,) if fmt == sglang_mla.NAME else ())):
        return Problem(f"SGLang would not build {'its MLA' if mla else 'an'} EAGLE-3 draft from this directory",
                       where,
                       f"architectures {archs}: SGLang builds {archs[0] if archs else 'nothing'}, not {served}",
                       "SGLang builds the class named by architectures[0] (sglang/srt/models/registry.py:93-104, "
                       "model_loader/utils.py:198-232)", fix, DIRECTORY, key="directory", remedy=CONVERT)
    return None


def served_ids(trainer, target_file: Path | None, root: Path) -> tuple[tuple[int, ...] | None, str]:
    """The eagle_config ids a conversion writes, and why. None (no ids: SGLang captures its default list,
    which is every trainer's default on every target class, conformance/wiring) when training used the
    default layers; else the ids with which SGLang captures the training layers: found on a twin of the
    target's own class (its set_eagle3_layers_to_capture and forward, conformance/user/wiring.py),
    or, without --target-config, in the Llama classes' convention (output of layer i: id - 1)."""
    from conformance.user.trainer import layer_names

    trained = trainer.training_ids()   # None: no ids stored or stated, every trainer's default list applies
    if trained is None:
        return None, "training used the default layers, which SGLang captures without ids"
    llama = tuple(i - 1 for i in trained)
    if target_file is None:
        return llama, (f"SGLang's Llama convention for {layer_names(trained)}, output of layer i = id - 1 "
                       "(llama.py set_eagle3_layers_to_capture); --target-config fits them to the target's class")
    from conformance.user.wiring import servable_ids

    ids = servable_ids(Path(target_file), trained, Path(root))
    if ids is None:
        return llama, (f"no ids make SGLang's class for {Path(target_file).name} capture {layer_names(trained)}; "
                       "the Llama convention is written and the wiring check shows what it captures")
    return ids, f"SGLang's class for {Path(target_file).name} captures {layer_names(trained)} with them (on its twin)"


def write_served_ids(draft_dir: Path, ids: tuple[int, ...] | None) -> None:
    """Put `ids` in a converted config.json's eagle_config (no ids: SGLang's default list)."""
    path = Path(draft_dir) / CONFIG_FILE
    config = json.loads(path.read_text())
    eagle = dict(config.get("eagle_config") or {})
    if ids is None:
        eagle.pop("eagle_aux_hidden_state_layer_ids", None)
    else:
        eagle.update(eagle_aux_hidden_state_layer_ids=list(ids), use_aux_hidden_state=True)
    if eagle:
        config["eagle_config"] = eagle
    else:
        config.pop("eagle_config", None)
    path.write_text(json.dumps(config, indent=2) + "\n")


def conversion_findings(source: Path, served: Path, intended: tuple[tuple[int, ...] | None, str],
                        accounts: dict) -> list[str]:
    """What the conversion did not keep: tensors, the aux ids SGLang reads (`intended`: served_ids'), the
    knobs SGLang builds."""
    out = []
    before, after = read_weights(source), read_weights(served)
    for name, tensor in sorted(before.items()):
        if name not in after:
            out.append(f"tensor {name}: missing from the conversion")
        elif after[name].dtype != tensor.dtype or not torch.equal(after[name], tensor):
            out.append(f"tensor {name}: not bit-exact after the conversion")
    expected, why = intended
    eagle = getattr(sglang_config(served), "eagle_config", None) or {}
    got = eagle.get("eagle_aux_hidden_state_layer_ids")
    if got != (None if expected is None else list(expected)):
        out.append(f"aux ids: SGLang reads eagle_config ids {got} (spec_aux_hidden_state.py:185-196); "
                   f"the conversion must give it {None if expected is None else list(expected)}: {why}")
    from conformance.adapters import DEFAULT_SERVER, REFERENCE

    ref, sgl = accounts[REFERENCE].knobs, accounts[DEFAULT_SERVER].knobs
    out += [f"{knob}: SGLang builds {sgl.get(knob)}, training has {ref.get(knob)}"
            for knob in KEPT_KNOBS if str(ref.get(knob)) != str(sgl.get(knob))]
    return out


def conversion_problem(findings: list[str], fmt: str) -> Problem | None:
    if not findings:
        return None
    return Problem(f"the conversion from the {fmt} format does not keep the draft", "; ".join(findings),
                   f"{len(findings)} difference(s) between the directory and its conversion",
                   "this suite's converter (conformance/checkpoints/formats.py: write_draft)",
                   "report it: the conversion must keep every tensor, id and norm", CONVERSION, key="conversion")
