"""vLLM's EAGLE-3 draft (`Eagle3LlamaForCausalLM`), built, loaded and run by vLLM's own code, in vLLM's own
environment (.venv-vllm: `python worker.py`). One persistent process per test session (importing vLLM
takes 30-50 s); adapter.py drives it over a pipe: one JSON request per line in, one JSON answer per line
out, tensors through safetensors files. Self-contained: it imports nothing of the project (whose
environment pins another torch and transformers), only vLLM, torch, safetensors, the files beside it and the
project's self-contained conformance/loading/observed_loaders.py.

What is vLLM's and what is the harness's:
- vLLM's: the config (EngineArgs -> create_engine_config, with its readers of the SGLang and speculators
  draft formats), the draft vllm config and the model build and load as its proposer does them
  (SpecDecodeBaseProposer._create_draft_vllm_config / _get_model, vllm/v1/spec_decode/llm_base_proposer.py:
  1265-1316: get_model under set_model_tag("eagle_head"), DefaultModelLoader -> load_weights), every layer,
  combine_hidden_states, the attention backend's metadata builder, compute_logits with its d2t scatter.
- the harness's (as the SGLang adapter builds SGLang's ForwardBatch): the target model config (a tiny
  LlamaForCausalLM config.json, no weights), the KV cache tensor, block tables and slot mapping that vLLM's
  scheduler and GPUModelRunner would give, and the calls the proposer makes (`propose()`, llm_base_proposer.py:
  511-770, needs the runner's device buffers): step 0 is the model over every scheduled token (:549-614),
  steps >= 1 one query per request on its last token, with the previous step's second output as hidden and
  the argmax of compute_logits as input id (:683-760). Block 0 is vLLM's null block (the KV cache manager
  never hands it out; block-table padding is 0), so tables start at 1.
- shims.py on a host without CUDA.

This file is the entry point and the request loop; the jobs are the files beside it, each imported by its
name (this folder is on sys.path, as a script's own folder is):
- worker_pipe.py: the pipe (stdout kept for the answers, requests in, answers out);
- worker_config.py: the target config.json, vLLM's engine config over it, the distributed groups;
- worker_load.py: the draft built and loaded as the proposer does (`load`), the loaded drafts by handle;
- worker_record.py: forward hooks on vLLM's modules and the canonical stages read off them;
- worker_run.py: the proposer's draft steps over the harness's KV cache and block tables (`run`);
- worker_replay.py: a step's bare pass timed (`replay`, the throughput figures);
- worker_accounting.py: `load_weights` replayed with its weight loaders observed (`account`, `ran`);
- worker_ids.py: the aux layer ids each model runner reads from the draft config (`aux_layers`);
- worker_capture.py: the target class's aux states observed in a forward (`capture`);
- worker_mla.py: the MLA draft's config reading and weight loading (`mla_reading`, `mla_config`, `mla_account`;
  no forward).
vLLM itself is imported where it is used, so that each file imports without it (and without the project's
modules): conformance/meta/test_vllm_worker.py imports each one so in the default lane.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loading"))   # observed_loaders.py: self-contained
import worker_pipe  # noqa: E402

_PROTOCOL = worker_pipe.claim_stdout()   # before torch and vLLM are imported: nothing they print reaches it

import shims  # noqa: E402
import torch  # noqa: E402
from worker_accounting import account, ran  # noqa: E402
from worker_capture import capture  # noqa: E402
from worker_ids import aux_layers  # noqa: E402
from worker_load import STATE, load  # noqa: E402
from worker_mla import mla_account, mla_config, mla_reading  # noqa: E402
from worker_replay import replay  # noqa: E402
from worker_run import run  # noqa: E402

# The requests adapter.py sends, by op ("quit" ends the loop).
OPS = {"load": load, "account": account, "run": run, "replay": replay, "ran": ran, "aux_layers": aux_layers,
       "capture": capture, "mla_reading": mla_reading, "mla_config": mla_config,
       "mla_account": mla_account}


def serve() -> None:
    import vllm

    applied = shims.install()
    ready = {"ok": True, "vllm": vllm.__version__, "torch": torch.__version__, "shims": applied,
             "platform": type(__import__("vllm.platforms", fromlist=["current_platform"]).current_platform).__name__}
    worker_pipe.send(_PROTOCOL, ready)
    worker_pipe.answer_requests(_PROTOCOL, OPS, "worker", before=drop_released)


def drop_released(req: dict) -> None:
    for handle in req.get("drop", ()):   # drafts the adapter no longer holds
        STATE["loaded"].pop(handle, None)

if __name__ == "__main__":
    serve()
