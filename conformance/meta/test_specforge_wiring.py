"""SpecForge's aux-id convention in the wiring matrix (conformance/wiring/cases.py TRAINERS["specforge"]) is
SpecForge's own, not a transcription: its resolver (`resolve_eagle_capture_layers`,
algorithms/model_providers.py:188-211) picks the ids, and its capture hands them to the target's
`set_eagle3_layers_to_capture` (offline_capture/sglang_backend/capture.py:86-87); the layers SGLang's
Llama then captures must be the boundaries the table says, for the default and for explicit ids."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.wiring.cases import N, TRAINERS
from fixtures.targets import TARGETS_BY_ID, write_target_config

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
TRAINER = TRAINERS["specforge"]


def resolved(ids: list[int] | None, num_layers: int) -> list[int]:
    """SpecForge's own choice of capture ids: no run override, the draft config's eagle_config, the target."""
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    run = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    draft_config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if ids is not None else {}
    return resolve_eagle_capture_layers(run, draft_config, SimpleNamespace(num_hidden_layers=num_layers))


@pytest.mark.parametrize("num_layers", [10, 32, 61])
def test_default_ids_are_specforges(num_layers):
    assert tuple(resolved(None, num_layers)) == TRAINER.default(num_layers)


@pytest.mark.parametrize("ids", [None, [2, 5, 8], [0, 4, 9]], ids=["default", "explicit", "with_0_and_last"])
def test_captured_layers_are_the_tables_boundaries(ids, tmp_path):
    """SpecForge's ids through SGLang's Llama target, as SpecForge's capture sets them: the captured
    boundaries (input of layer b) are TRAINERS["specforge"].boundaries."""
    from conformance.adapters.sglang.target import build_target

    spec = TARGETS_BY_ID["llama"]
    target = build_target(spec, write_target_config(spec, tmp_path / spec.id))
    layer_ids = resolved(ids, N)
    target.model.set_eagle3_layers_to_capture(layer_ids)
    assert tuple(target.layers_to_capture) == TRAINER.boundaries(None if ids is None else tuple(ids), N), \
        f"SpecForge ids {layer_ids}: SGLang's Llama captures {target.layers_to_capture}"


def test_resolver_refuses_what_the_table_cannot_mean():
    """Exactly three non-negative ids (model_providers.py:206-210): a table entry with other ids is not SpecForge's."""
    with pytest.raises(ValueError, match="exactly three"):
        resolved([1, 2], N)
