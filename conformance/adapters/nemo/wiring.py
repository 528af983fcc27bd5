"""NeMo Automodel 0.7.0's capture of the target's aux hidden states in training, by its own code: which target
layers its trainer feeds the draft, for the wiring area to run on the suite's targets (the adapter's
`training_capture`).

NeMo has two target backends that capture the same ids
(nemo_automodel/components/speculative/eagle/):
- its HF target (`HFEagle3TargetModel`, target.py:158-385), the co-located default: a forward hook on decoder
  layer i keeps that layer's output (target.py:276-285), so id i is the output of layer i, the input of layer
  i + 1;
- its SGLang target runner (`SGLangTargetRunner`, sglang_runner.py), which hands the ids to the SGLang target
  class's own `set_eagle3_layers_to_capture` (sglang_runner.py:267-269, called once by
  `RunnerEagle3TargetModel.__init__`, target_runner.py:104-113): id i then means whatever that class makes of
  it, exactly as for eagle_config ids a server reads.
Both take `default_eagle3_aux_layer_ids(N)` = [1, N//2 - 1, N - 4] when the run sets no `aux_layer_ids`
(target.py:42-61, shared by every backend) and refuse anything but three distinct ids in [0, N)
(target.py:64-84). The draft config the recipe saves carries no ids at all (recipes/llm/train_eagle3.py:610-650:
the target's config with the draft keys), so a server learns nothing of them from the checkpoint.

The SGLang runner's `build` needs CUDA and a ModelRunner (sglang_runner.py:207-208); here NeMo's runner wraps the
SGLang target class the wiring area already built, through the one attribute `set_aux_layers` and `model` read
(sglang_runner.py:181-183, 269): `_ModelRunner` below. Its forward (`_extend`, a GPU ModelRunner's extend with
CaptureHiddenMode.FULL, sglang_runner.py:292-345) is not run: the wiring area runs the same class's forward with
the same capture mode (conformance/adapters/sglang/target.py), through the default server's `target_capture`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TRAINER = "nemo"   # its key in the wiring area's training conventions (conformance/wiring/cases.py TRAINERS)
BACKENDS = ("hf target", "sglang runner")   # what each capture below is, in NeMo's own words


def default_ids(num_layers: int) -> tuple[int, ...]:
    """NeMo's own default ids for an N-layer target (ValueError where it refuses the depth, target.py:54-60)."""
    from nemo_automodel.components.speculative.eagle.target import default_eagle3_aux_layer_ids

    return tuple(default_eagle3_aux_layer_ids(num_layers))


def refusal(architectures: list[str]) -> str | None:
    """Why NeMo's EAGLE-3 recipe trains no draft for a target of these architectures (its registry's own error,
    registry.py:139-153, the recipe's first step, train_eagle3.py:547-552), or None."""
    from nemo_automodel.components.speculative.eagle.registry import resolve_eagle3_draft_spec

    try:
        resolve_eagle3_draft_spec(list(architectures))
    except ValueError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]} (speculative/eagle/registry.py:139-148)"
    return None


@dataclass(frozen=True)
class Capture:
    ids: tuple[int, ...]     # the ids NeMo used (its default when none were given)
    aux: torch.Tensor        # [T, k * H]: the concatenated aux states the draft is trained on


@torch.no_grad()
def hf_capture(model: torch.nn.Module, input_ids: torch.Tensor, ids: tuple[int, ...] | None = None) -> Capture:
    """NeMo's HF target backend on a transformers causal LM: `generate_batch` on one unpadded row, its aux
    hidden states (position-aligned, not shifted, target.py:361 and :376-377)."""
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    backend = HFEagle3TargetModel(model, aux_layer_ids=None if ids is None else list(ids))
    row = input_ids.reshape(1, -1)
    batch = backend.generate_batch(row, torch.ones_like(row), torch.ones_like(row))
    return Capture(tuple(backend.aux_layer_ids), batch.aux_hidden_states[0].detach().clone())


class _ModelRunner:
    """What NeMo's SGLangTargetRunner reads of SGLang's ModelRunner to set the capture: its `model`
    (sglang_runner.py:181-183, 269). `build` would make a real one on CUDA only (sglang_runner.py:207-208)."""

    def __init__(self, model):
        self.model = model


def runner_capture(sglang_model, ids: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """NeMo's SGLang target runner set up on SGLang's target class `sglang_model`, as its backend does it
    (RunnerEagle3TargetModel: default or validated ids, then runner.set_aux_layers -> the class's
    set_eagle3_layers_to_capture): the ids it handed SGLang. The class's forward then captures them."""
    from nemo_automodel.components.speculative.eagle.sglang_runner import SGLangTargetRunner
    from nemo_automodel.components.speculative.eagle.target_runner import RunnerEagle3TargetModel

    backend = RunnerEagle3TargetModel(SGLangTargetRunner(_ModelRunner(sglang_model)),
                                      aux_layer_ids=None if ids is None else list(ids))
    return tuple(backend.aux_layer_ids)
