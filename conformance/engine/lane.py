"""The engine lane's session store: each engine group served once, its references computed once.

A group's engine is started, serves its scenarios wave by wave, and is shut down before the next one
starts (one engine at a time, none left running). The checks read the outputs, SGLang's meta_info and
the capture's rounds, against the target's greedy continuation (transformers `generate`) and the
reference draft's simulation of the same requests.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER, DEFAULT_TRAINER, REFERENCE
from conformance.engine.check import CLAIMED
from conformance.engine.scenarios import EngineGroup, Prompt, Scenario
from conformance.engine.served import ServedRound, gathered_rounds, served_rounds
from conformance.engine.simulate import ReferenceRound, chain_rounds, tree_rounds
from conformance.acceptance.trained_draft import TrainedDraft
from reference.tree import Attends

# The default server's real serving engine (SGLang's Engine: conformance/adapters/sglang/engine.py).
ENGINE = ADAPTERS[DEFAULT_SERVER].engine


@dataclass
class Request:
    prompt: Prompt
    served: ENGINE.Served
    rounds: list[ServedRound]

    @property
    def label(self) -> str:
        return f"request seq {self.prompt.seq}, prompt {self.prompt.length} tokens"


@dataclass
class ScenarioRun:
    scenario: Scenario
    requests: list[Request]
    seconds: float


@dataclass
class GroupRun:
    group: EngineGroup
    resolved: dict = field(default_factory=dict)     # server arguments as SGLang resolved them
    shims: dict = field(default_factory=dict)        # what the scheduler process changed (before -> after)
    start_seconds: float = 0.0
    scenarios: dict[str, ScenarioRun] = field(default_factory=dict)
    error: str | None = None                         # the engine did not start or serve: one line
    drafter: str = ""                                # the speculative worker class its scheduler built
    trainer: str | None = None                       # whose draft it served, when not the default trainer's
    ipc_dir: str = ""                                # where the engine's IPC sockets were made
    ipc_paths: tuple[str, ...] = ()                  # their files
    left_behind: tuple[str, ...] = ()                # of those (and the directory), what shutdown left

    def leftovers_failure(self) -> str | None:
        """SGLang's IPC files must be made in the engine's own directory and gone with it after shutdown
        (engine.ipc_names_in): otherwise every engine leaves files in the host's temp directory."""
        outside = [p for p in self.ipc_paths if os.path.dirname(p) != self.ipc_dir]
        if not (outside or self.left_behind):
            return None
        return (f"sglang engine {self.group.id}: IPC files " + (f"made outside {self.ipc_dir}: {outside}" if outside
                else f"left after shutdown: {list(self.left_behind)}"))


class EngineLane:
    def __init__(self, trained: TrainedDraft, root: Path):
        self.trained, self.root = trained, root
        self._runs: dict[str, GroupRun] = {}
        self._chains: dict[tuple, list[ReferenceRound]] = {}
        self._greedy: dict[tuple, list[int]] = {}
        self._target = self._reference = None
        self._live: ENGINE.ServedEngine | None = None
        self.memo: dict = {}          # derived results (findings), computed once per session
        self.recorded: set = set()    # report rows already written (per engine group)
        self.reference_seconds = 0.0

    # ------------------------------------------------------------ serving

    def run(self, group: EngineGroup) -> GroupRun:
        if group.id not in self._runs:
            self._runs[group.id] = self._serve(group)
        return self._runs[group.id]

    def _serve(self, group: EngineGroup) -> GroupRun:
        run = GroupRun(group, trainer=None if self.trained.trainer == DEFAULT_TRAINER else self.trained.trainer)
        capture = self.root / group.id
        outputs: list[tuple[Scenario, list[tuple[Prompt, ENGINE.Served]], float]] = []
        try:
            engine = self.start_engine(group, capture)
        except Exception as exc:   # SGLang's own words, on one line
            run.error = f"engine {group.id} did not start: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            return run
        self._live = engine
        try:
            run.start_seconds = engine.start_seconds
            run.ipc_dir, run.ipc_paths = engine.ipc_dir, tuple(engine.ipc_paths())
            run.resolved = engine.resolved()
            for scenario in group.scenarios:
                start, served = time.perf_counter(), []
                for wave in scenario.waves:
                    prompts = [self.prompt_ids(p) for p in wave]
                    served += zip(wave, engine.generate(prompts, scenario.new_tokens))
                outputs.append((scenario, served, time.perf_counter() - start))
            run.shims, run.drafter = engine.shims(), engine.drafter()
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0]
            run.error = f"engine {group.id} failed while serving: {type(exc).__name__}: {first_line}"
        finally:
            engine.shutdown()
            self._live = None
        run.left_behind = tuple(p for p in (run.ipc_dir, *run.ipc_paths) if p and os.path.lexists(p))
        rounds = served_rounds(ENGINE.read_events(capture), group.topk)
        if group.tp_size > 1:   # each rank's draft computed its own heads: the rounds get them all
            per_rank = [rounds] + [served_rounds(ENGINE.read_events(capture, rank), group.topk)
                                   for rank in range(1, group.tp_size)]
            rounds = gathered_rounds(per_rank, ADAPTERS[DEFAULT_SERVER].tensor_parallel.HEAD_SHARDED)
        for scenario, served, seconds in outputs:
            requests = [Request(p, s, rounds.get(s.meta["id"], [])) for p, s in served]
            run.scenarios[scenario.id] = ScenarioRun(scenario, requests, seconds)
        return run

    def start_engine(self, group: EngineGroup, capture: Path) -> ENGINE.ServedEngine:
        """The group's engine, started (this host's: SGLang's Engine on CPU with its shims)."""
        return ENGINE.ServedEngine(self.trained.target_dir, self.served_checkpoint, capture,
                                   group.server_args(), env=group.env, fault_yaml=group.fault_yaml)

    @property
    def claimed(self) -> frozenset[str]:
        """The stages the engine's capture has of this draft (the Llama draft's every canonical stage; an MLA
        draft's its own)."""
        return ENGINE.claimed_stages(self.trained.config) or CLAIMED

    @property
    def served_checkpoint(self) -> Path:
        """The draft directory the server loads: the trained draft in the server's format for it (SGLang's own; an
        MLA draft in sglang-mla, Eagle3DeepseekV2ForCausalLM's)."""
        return self.trained.checkpoints[ADAPTERS[DEFAULT_SERVER]().format_for(self.trained.config)]

    # ------------------------------------------------------------ the other side

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.trained.heldout_ids[prompt.seq, :prompt.length].tolist()

    @property
    def target(self):
        if self._target is None:
            self._target = self.trained.target()
        return self._target

    @property
    def reference(self):
        """The reference draft (speculators-format checkpoint, training semantics), fp32."""
        if self._reference is None:
            self._reference = ADAPTERS[REFERENCE]().load(self.trained.checkpoints["speculators"], torch.float32)
        return self._reference

    def greedy(self, prompt: Prompt, new_tokens: int) -> list[int]:
        """The target's greedy continuation by transformers' own generate (eos is a real token here)."""
        from transformers import GenerationConfig

        key = (prompt, new_tokens)
        if key not in self._greedy:
            ids = torch.tensor([self.prompt_ids(prompt)])
            config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, bos_token_id=None)
            with torch.no_grad():   # an explicit mask: generate would mask prompt tokens equal to pad_token_id
                out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            self._greedy[key] = out[0, ids.shape[1]:].tolist()
        return self._greedy[key]

    def chain(self, prompt: Prompt, steps: int, new_tokens: int) -> list[ReferenceRound]:
        """The reference draft's greedy chain speculative decoding of the same request."""
        key = (prompt, steps, new_tokens)
        if key not in self._chains:
            start = time.perf_counter()
            self._chains[key] = chain_rounds(self.reference, self.target, torch.tensor(self.prompt_ids(prompt)),
                                             steps, new_tokens, self.trained.config.aux_layer_ids)
            self.reference_seconds += time.perf_counter() - start
        return self._chains[key]

    def tree(self, group: EngineGroup, prompt: Prompt, num_draft_tokens: int, new_tokens: int,
             attends: Attends) -> list[ReferenceRound]:
        """The reference tree's speculative decoding of the same request (attends: its attention rule,
        reference/tree.py)."""
        key = (prompt, group.steps, group.topk, num_draft_tokens, new_tokens, attends)
        if key not in self._chains:
            start = time.perf_counter()
            self._chains[key] = tree_rounds(
                self.reference.model, self.target, self.prompt_ids(prompt), self.greedy(prompt, new_tokens),
                self.trained.config.aux_layer_ids, group.steps, group.topk, num_draft_tokens, new_tokens, attends)
            self.reference_seconds += time.perf_counter() - start
        return self._chains[key]

    def close(self) -> None:
        """Shut down an engine still up (a group is shut down once served; this covers an interruption)."""
        if self._live is not None:
            self._live.shutdown()
            self._live = None
