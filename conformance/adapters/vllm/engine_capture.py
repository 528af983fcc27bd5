"""What vLLM's serving engine does with a draft, observed inside it (part of engine_worker.py, in the vLLM engine
environment): forward hooks on the draft model (worker_record.Recorder: the canonical stages of every pass), and
wrappers around four of vLLM's own methods that call the original with the same arguments and return its result
unchanged, recording what went in and out:

- the rejection sampler (RejectionSampler, an nn.Module: a forward hook): the drafts each request had verified in
  this engine step (SpecDecodeMetadata.num_draft_tokens) and what it accepted (output rows, -1 past the accepted);
- `EagleProposer.propose` (vllm/v1/spec_decode/llm_base_proposer.py:512-781): one drafting call, its batch in the
  runner's order (InputBatch.req_ids), which requests' drafts the runner discards (a partial prefill chunk:
  GPUModelRunner.discard_request_mask, gpu_model_runner.py:2058-2061), and the drafted target ids [B, K];
- `set_inputs_first_pass` (:817): step 0's rows per request (query_start_loc) and the row each request samples
  (token_indices_to_sample: the last accepted one);
- the draft model's `combine_hidden_states` (llama_eagle3.py): the target's aux states and fc's output.

One event per drafting call, written as event_<n>.safetensors (tensors) with its metadata; the project side
(engine.py) cuts them into rounds. Planted faults (FAULTS) are patches of vLLM's own methods, for the meta tests
only. vLLM is imported where it is used (this file imports without it).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from worker_record import Recorder, canonical, first


class Capture:
    """The hooks on one engine's runner and draft model, and the events they write to `out`."""

    def __init__(self, runner, out: Path):
        self.runner, self.out = runner, out
        self.proposer = runner.drafter
        self.model = self.proposer.model
        self.recorder = Recorder(self.model)
        self.loaded = SimpleNamespace(model=self.model)   # what worker_record.canonical reads
        self.count = 0
        self.verified = None      # the rejection sampler's result of this engine step
        self.call = None          # the drafting call in progress
        self._install()

    # ------------------------------------------------------------ the hooks

    def _install(self) -> None:
        capture, proposer, model = self, self.proposer, self.model

        def sampled(module, args, output):
            metadata = args[0]
            capture.verified = {"num_draft_tokens": list(metadata.num_draft_tokens),
                                "sampled": output.sampled_token_ids.detach().cpu().clone()}
        self.runner.rejection_sampler.register_forward_hook(sampled)

        propose = proposer.propose

        def propose_observed(*args, **kwargs):
            capture.begin()
            try:
                drafts = propose(*args, **kwargs)
            except BaseException:
                capture.call = None
                raise
            capture.end(drafts)
            return drafts
        proposer.propose = propose_observed

        first_pass = proposer.set_inputs_first_pass

        def first_pass_observed(*args, **kwargs):
            num_tokens, sample_rows, cad = first_pass(*args, **kwargs)
            if capture.call is not None:
                capture.call["query_start_loc"] = cad.query_start_loc_cpu[:cad.num_reqs + 1].tolist()
                capture.call["sample_rows"] = sample_rows.detach().cpu().tolist()
            return num_tokens, sample_rows, cad
        proposer.set_inputs_first_pass = first_pass_observed

        combine = model.combine_hidden_states

        def combine_observed(hidden_states):
            fused = combine(hidden_states)
            if capture.call is not None:
                seen = capture.recorder.take()
                norms = [first(seen[k]) for k in sorted(k for k in seen if k.startswith("fc_norm."))]
                capture.call["fc"] = {"aux_in": hidden_states.detach().clone(), "fc_out": fused.detach().clone(),
                                      **({"fc_in_norm": torch.cat(norms, dim=-1)} if norms else
                                         {"fc_in_norm": first(seen["input_norm"])} if "input_norm" in seen else {})}
            return fused
        model.combine_hidden_states = combine_observed

        def pass_begins(module, args, kwargs):
            if capture.call is None:
                return
            capture.finish_pass()
            capture.recorder.take()
            capture.call["current"] = {"input_ids": kwargs["input_ids"].detach().clone(),
                                       "positions": kwargs["positions"].detach().clone(),
                                       "hidden": kwargs["hidden_states"].detach().clone()}

        def pass_ends(module, args, kwargs, output):
            if capture.call is not None and capture.call.get("current") is not None:
                capture.call["current"]["output"] = tuple(o.detach().clone() for o in output)
        model.register_forward_pre_hook(pass_begins, with_kwargs=True)
        model.register_forward_hook(pass_ends, with_kwargs=True)

    # ------------------------------------------------------------ one drafting call

    def begin(self) -> None:
        runner = self.runner
        n = runner.input_batch.num_reqs
        self.recorder.take()
        self.call = {"req_ids": list(runner.input_batch.req_ids[:n]),
                     "discarded": [bool(x) for x in runner.discard_request_mask.np[:n]],
                     "verified": self.verified, "passes": [], "current": None}
        self.verified = None

    def finish_pass(self) -> None:
        """The pass in progress (its logits come after the model's forward: compute_logits) as canonical stages."""
        current = self.call.get("current")
        if current is None or "output" not in current:
            return
        seen = self.recorder.take()
        last_hidden, aux_out = current["output"]
        T = current["input_ids"].shape[0]
        step = len(self.call["passes"])
        stages = canonical(self.loaded, seen, current["input_ids"], None if step == 0 else current["hidden"][:T],
                           aux_out[:T])
        if "logits" in seen:
            stages["logits"] = first(seen["logits"])
        stages["positions"] = current["positions"][:T].clone()
        self.call["passes"].append(stages)
        self.call["current"] = None

    def end(self, drafts: torch.Tensor) -> None:
        self.finish_pass()
        call, self.call = self.call, None
        self.count += 1
        tensors = {"draft_tokens": drafts.detach().cpu().long().clone()}
        for name, value in call.get("fc", {}).items():
            tensors[f"pass0/stage:{name}"] = value
        for k, stages in enumerate(call["passes"]):
            for name, value in stages.items():
                key = f"pass{k}/positions" if name == "positions" else f"pass{k}/stage:{name}"
                tensors[key] = value.detach().cpu().contiguous()
        verified = call["verified"]
        if verified is not None:
            tensors["sampled"] = verified["sampled"]
        meta = {"call": self.count, "req_ids": call["req_ids"], "discarded": call["discarded"],
                "query_start_loc": call.get("query_start_loc"), "sample_rows": call.get("sample_rows"),
                "passes": len(call["passes"]),
                "num_draft_tokens": None if verified is None else verified["num_draft_tokens"]}
        path = self.out / f"event_{self.count:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"meta": json.dumps(meta)})


# ---------------------------------------------------------------- planted faults (meta tests only)

def _advance_draft_positions(runner) -> str:
    """The proposer's draft-step position update (_update_positions_dependent_metadata, llm_base_proposer.py:783-815)
    followed by one more +1 on the positions the next pass reads (the slot mapping it computed stays right)."""
    proposer = runner.drafter
    update = proposer._update_positions_dependent_metadata

    def advanced(positions, common_attn_metadata, batch_size, input_batch_size, block_size):
        update(positions, common_attn_metadata, batch_size, input_batch_size, block_size)
        proposer.positions[:batch_size] += 1
        return proposer.positions[:batch_size]
    proposer._update_positions_dependent_metadata = advanced
    return "EagleProposer._update_positions_dependent_metadata: draft-step positions advanced one more"


def _aux_from_shallower_layers(runner) -> str:
    """The runner's EAGLE-3 aux-layer setup (GPUModelRunner._setup_eagle3_aux_hidden_state_outputs,
    gpu_model_runner.py:5230-5249) hands the target every id one lower: each aux state one layer shallower."""
    model = runner.get_model()
    layers = tuple(model.model.aux_hidden_state_layers)
    model.set_aux_hidden_state_layers(tuple(i - 1 for i in layers))
    return f"set_aux_hidden_state_layers({layers}) -> {tuple(i - 1 for i in layers)}"


def _sample_row_before_last(runner) -> str:
    """set_inputs_first_pass (llm_base_proposer.py:817) returns, per request with more than one row in step 0, the
    row before the one to sample (the last accepted): its logits draft the first token and its hidden state feeds
    step 1."""
    proposer = runner.drafter
    first_pass = proposer.set_inputs_first_pass

    def before_last(*args, **kwargs):
        num_tokens, rows, cad = first_pass(*args, **kwargs)
        starts = cad.query_start_loc[:cad.num_reqs].to(rows.device)
        return num_tokens, torch.where(rows > starts, rows - 1, rows), cad
    proposer.set_inputs_first_pass = before_last
    return "EagleProposer.set_inputs_first_pass: the row before the last accepted one sampled"


FAULTS = {"draft_positions_advanced": _advance_draft_positions, "aux_from_shallower_layers": _aux_from_shallower_layers,
          "sample_row_before_last": _sample_row_before_last}
