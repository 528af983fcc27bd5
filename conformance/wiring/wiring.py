"""Target-side wiring: which target layers feed the draft in training, and which in SGLang.

Training side: each trainer's own id convention applied to the transformers target's hidden states.
Serving side: SGLang's real target class, fed the ids SGLang itself reads from the draft config.
Compared: the concatenated aux tensor, slot by slot; a mismatch prints both layer lists side by side.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER, DEFAULT_TRAINER
from fixtures.targets import (
    TARGET_HIDDEN, TargetSpec, make_hf_target, make_target_input, write_target_config,
)
from fixtures.tiny import make_config

from conformance.core.common import remembered
from conformance.wiring.cases import CAPTURE_FAILED, DTYPE, N, REFUSED, WiringCase, boundary_name, draft_config_json
from conformance.wiring.comparison import TARGET, WiringComparison, compare_capture, describe_read


# ---------------------------------------------------------------- session store

@dataclass
class TargetRun:
    spec: TargetSpec
    input_ids: torch.Tensor              # [T]
    states: list[torch.Tensor]           # HF boundaries 0..N, each [T, Ht] (N: before the final norm)
    hf_logits: torch.Tensor              # [T, V]
    sglang: TARGET.SGLangTarget
    hf: torch.nn.Module                  # the transformers target (tie_last_hidden_states off)


class WiringStore:
    """Targets built once (transformers and SGLang, same weights), draft configs written once per case."""

    def __init__(self, root: Path, seed: int = 0):
        self.root, self.seed = root, seed
        self._targets: dict[str, TargetRun] = {}
        self._capture_only: dict[str, TARGET.SGLangTarget] = {}
        self._configs: dict[tuple[str, str], Path] = {}
        # SGLang's forward per (target, layers_to_capture): with the same weights and prompt it is a
        # function of those alone, so cases that resolve to the same layers share one forward.
        self._forwards: dict[tuple, tuple[torch.Tensor, torch.Tensor] | TARGET.CaptureFailed] = {}

    def target(self, spec: TargetSpec) -> TargetRun:
        if spec.id not in self._targets:
            hf, weights = make_hf_target(spec, torch.Generator().manual_seed(self.seed))
            ids = make_target_input(torch.Generator().manual_seed(self.seed + 1))
            with torch.no_grad():
                out = hf(ids[None], output_hidden_states=True)
            states = [h[0].detach().clone() for h in out.hidden_states]
            assert len(states) == spec.text_config["num_hidden_layers"] + 1
            sglang = TARGET.load_target(spec, write_target_config(spec, self.root / "targets" / spec.id), weights)
            self._targets[spec.id] = TargetRun(spec, ids, states, out.logits[0].detach().clone(), sglang, hf)
        return self._targets[spec.id]

    def draft_dir(self, case: WiringCase, fmt: str) -> Path:
        key = (case.id, fmt)
        if key not in self._configs:
            d = self.root / "drafts" / case.id / fmt
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(json.dumps(draft_config_json(case, fmt), indent=2) + "\n")
            self._configs[key] = d
        return self._configs[key]

    def serve(self, spec: TargetSpec, case: WiringCase, fmt: str) -> tuple[WiringComparison, torch.Tensor | None]:
        """SGLang's capture for this draft config on this target, compared with training's; and the aux tensor."""
        comparison, aux = self._serve(spec, case, fmt)
        comparison.trained = case.describe()
        return comparison, aux

    def _serve(self, spec: TargetSpec, case: WiringCase, fmt: str) -> tuple[WiringComparison, torch.Tensor | None]:
        case_id = f"{spec.id}-{case.id}-{fmt}"
        run = self.target(spec)
        try:
            aux_ids = TARGET.sglang_aux_layer_ids(self.draft_dir(case, fmt), self.root)
        except TARGET.DraftConfigRefused as exc:
            return WiringComparison(case_id, case.boundaries, "nothing", None, None, f"{fmt}/config.json: {exc}",
                                    REFUSED, error_class=exc.error), None
        run.sglang.set_capture(aux_ids)
        read, layers = describe_read(aux_ids), tuple(run.sglang.layers_to_capture)
        try:
            aux, _ = self.forward(run, aux_ids.use_aux)
        except TARGET.CaptureFailed as exc:
            return WiringComparison(case_id, case.boundaries, read, layers, None, f"target forward: {exc}",
                                    CAPTURE_FAILED, error_class=exc.error), None
        return compare_capture(case_id, case.boundaries, run.states, aux, read, layers), aux

    def forward(self, run: TargetRun, use_aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's (aux, logits) for the target as currently configured; raises CaptureFailed."""
        key = (run.spec.id, use_aux, tuple(run.sglang.layers_to_capture))
        return remembered(self._forwards, key, lambda: run.sglang.run(run.input_ids), TARGET.CaptureFailed)

    def capture_ids_only(self, spec: TargetSpec, case: WiringCase, fmt: str) -> WiringComparison:
        """For a class whose forward cannot run here: SGLang's ids and the class's own
        set_eagle3_layers_to_capture, with the served list read off layers_to_capture (the boundaries
        its forward visits: 0..N for gpt-oss, gpt_oss.py:708-740, in layer order, each once)."""
        case_id = f"{spec.id}-{case.id}-{fmt}"
        if spec.id not in self._capture_only:
            config_dir = write_target_config(spec, self.root / "targets" / spec.id)
            self._capture_only[spec.id] = TARGET.build_target(spec, config_dir)
        target = self._capture_only[spec.id]
        try:
            aux_ids = TARGET.sglang_aux_layer_ids(self.draft_dir(case, fmt), self.root)
        except TARGET.DraftConfigRefused as exc:
            return WiringComparison(case_id, case.boundaries, "nothing", None, None, f"{fmt}/config.json: {exc}",
                                    REFUSED, derived=True, error_class=exc.error)
        target.set_capture(aux_ids)
        layers = tuple(target.layers_to_capture)
        served = tuple(boundary_name(b) for b in sorted({b for b in layers if 0 <= b <= N}))
        return WiringComparison(case_id, case.boundaries, describe_read(aux_ids), layers, served, derived=True,
                                trained=case.describe())

    # ------------------------------------------------------------ end to end: target -> aux -> draft

    def end_to_end(self, spec: TargetSpec, case: WiringCase, fmt: str, seed: int = 0):
        """(default server vs trainer Comparison, wiring): the same draft weights, each side fed by its own target.

        Serving: SGLang's target capture -> SGLang's LlamaForCausalLMEagle3 (sglang-format checkpoint).
        Training: the trainer's capture from transformers -> speculators' Eagle3DraftModel (speculators
        format). Each side's draft input ids are its prompt shifted by one plus its own target's next token.
        """
        from conformance.core.compare import compare_traces
        from fixtures.checkpoint import write_checkpoints
        from fixtures.tiny import make_draft_weights
        from reference.eagle3 import DraftBatch

        wiring, serving_aux = self.serve(spec, case, fmt)
        if serving_aux is None:
            raise ValueError(f"{wiring.case_id}: SGLang produced no aux tensor ({wiring.error})")
        run = self.target(spec)
        training_aux = torch.cat([run.states[b] for b in case.boundaries], dim=-1)
        _, sglang_logits = self.forward(run, True)
        cfg = make_config(hidden_size=TARGET_HIDDEN, target_hidden_size=TARGET_HIDDEN,
                          num_aux_hidden_states=len(case.boundaries), aux_layer_ids=case.boundaries)
        dirs = write_checkpoints(cfg, make_draft_weights(cfg, torch.Generator().manual_seed(seed)),
                                 self.root / "end_to_end" / wiring.case_id)
        T = run.input_ids.shape[0]

        def batch(aux, next_token):
            ids = torch.cat([run.input_ids[1:], next_token.reshape(1)])
            return DraftBatch(aux=aux.double(), input_ids=ids, positions=torch.arange(T),
                              seq_ids=torch.zeros(T, dtype=torch.long))

        server, trainer = ADAPTERS[DEFAULT_SERVER](), ADAPTERS[DEFAULT_TRAINER]()
        served = server.load(dirs[server.checkpoint_format], DTYPE, device=run.sglang.device).run(
            batch(serving_aux, sglang_logits[-1].argmax())).on_cpu()
        trained = trainer.load(dirs[trainer.checkpoint_format], DTYPE).run(
            batch(training_aux, run.hf_logits[-1].argmax()))
        comparison = compare_traces(served, trained, wiring.case_id)
        return comparison, wiring
