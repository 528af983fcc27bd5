"""SGLang's target and EAGLE-3 draft sharded over tensor-parallel ranks on CPU, each rank a process of its own.

Every rank runs SGLang's own distributed code: `init_distributed_environment` and `initialize_model_parallel`
over gloo (the CPU backend of sglang/srt/distributed/parallel_state.py), ServerArgs published with `tp_size`
and the rank's SpawnRanks, then SGLang's target class (vocabulary-parallel embedding, QKV/row-parallel
linears, its all-reduces and the logits all-gather) capturing the aux states, and `LlamaForCausalLMEagle3`
(its parallel layers, vocabulary-parallel `lm_head` and d2t) drafting from them. A round is one draft
EXTEND over a context plus DECODE steps, as the EAGLE worker runs it after a verify; successive rounds
are successive held-out prefixes. Each rank sends back what the areas compare across ranks and with
TP 1: its effective weight shards (after any sharing with the target), the aux states it received and,
per round, its trace (head-sharded stages are this rank's heads) and drafted tokens.

Two runtime adjustments, both in `_rank_runtime`:
- the RoPE `_is_cpu` flag (runtime.cpu_runtime_adjustments, as in every SGLang process here);
- `SGLANG_NCCL_SO_PATH` names a library that does not exist: this venv's torch is a CUDA build that ships
  libnccl, so SGLang's group set-up would open a PyNccl communicator on the CPU and fail in
  `torch.cuda.device(cpu)` (parallel_state.py:463, pynccl.py:116). With the library absent SGLang disables
  PyNccl itself (pynccl.py:73-79), as it does under a CPU torch build; collectives then go over gloo
  (`GroupCoordinator.all_reduce`, parallel_state.py:695-699: `is_shm_available` is false on a host without
  AMX, else it would call sgl_kernel's CPU `shm_allreduce`, which is not installable here).

Planted rank faults (RankFault) go through SGLang's own mechanisms on one rank only: the draft taking the
target's embedding (`set_embed`, what eagle_worker_v2.py:363 calls) and the target capturing shifted aux ids
(`configure_aux_hidden_state_capture`, what the model runner calls).
"""
from __future__ import annotations

import hashlib
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

RANK_TIMEOUT_S = 600
# Head-sharded stages: [tokens, heads, head_dim] (split on dim 1) or [tokens, heads * head_dim] (dim -1).
HEAD_SHARDED = {"q": 1, "k": 1, "v": 1, "q_rot": 1, "k_rot": 1, "attn_core": -1}
FAULTS = ("target_embedding", "aux_ids_shifted")
HOT = "hot_token_id (d2t + arange)"


@dataclass(frozen=True)
class RankFault:
    rank: int
    kind: str   # one of FAULTS

    def describe(self) -> str:
        what = {"target_embedding": "its draft takes the target's embedding (set_embed)",
                "aux_ids_shifted": "its target captures the aux ids shifted by one "
                                   "(configure_aux_hidden_state_capture)"}
        return f"rank {self.rank}: {what[self.kind]}"


@dataclass
class RankRound:
    context: list[int]
    input_ids: list[int]       # what the draft EXTEND embedded: context[1:] and the target's next token
    aux: torch.Tensor          # the aux states this rank's draft received [T, A*Ht]
    trace: object              # conformance.core.trace.Trace of this rank (its own head shards)
    drafted: list[int]         # target-vocabulary ids drafted at steps 0..K-1


@dataclass
class RankRun:
    rank: int
    tp_size: int
    settings: dict                               # what SGLang resolved on this rank
    weights: dict[str, torch.Tensor]             # effective parameter shards, after sharing with the target
    shard_dims: dict[str, int | None]            # the dim SGLang shards each parameter on (None: replicated)
    as_loaded: dict[str, str]                    # digest of each parameter as SGLang's loader left it
    rounds: list[RankRound] = field(default_factory=list)
    seconds: float = 0.0


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:12]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worlds(adapter, draft_dir: Path, target_dir: Path, target_spec: str, contexts: list[list[int]], steps: int,
               tp_sizes: tuple[int, ...], faults: list[RankFault | None], out: Path) -> dict[int, list[list[RankRun]]]:
    """`adapter`: the adapter class whose `load` each rank runs (its own loader, under the rank's world).
Every TP size's world with all its ranks, all at once; each rank runs every scenario of `faults`
    (None: no fault; a fault acts on its rank only) on one load. Returns tp size -> per scenario, its
    ranks' runs in rank order. Raises RuntimeError naming the world and rank that failed, SGLang's words."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for tp in tp_sizes:
        port = _free_port()
        for rank in range(tp):
            path = out / f"tp{tp}-rank{rank}.pt"
            path.unlink(missing_ok=True)
            args = (adapter, rank, tp, port, str(draft_dir), str(target_dir), target_spec, contexts, steps, faults,
                    str(path))
            p = ctx.Process(target=_rank_main, args=args, daemon=True)
            p.start()
            procs.append((tp, rank, p, path))
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for _, _, p, _ in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    results: dict[int, list] = {tp: [] for tp in tp_sizes}
    errors = []
    for tp, rank, p, path in procs:
        if p.is_alive():
            p.kill()
            p.join()
            errors.append(f"TP {tp} rank {rank}: no answer within {RANK_TIMEOUT_S} s")
            continue
        got = torch.load(path, weights_only=False) if path.is_file() else None
        if isinstance(got, list):
            results[tp].append(got)
        else:
            errors.append(f"TP {tp} rank {rank}: " + (got if isinstance(got, str) else f"exit code {p.exitcode}"))
    if errors:
        raise RuntimeError("; ".join(errors))
    # rank -> scenario becomes scenario -> rank
    return {tp: [list(per_scenario) for per_scenario in zip(*ranks)] for tp, ranks in results.items()}


def _rank_main(adapter, rank, tp, port, draft_dir, target_dir, target_spec, contexts, steps, faults, path):
    try:
        runs = _rank(adapter, rank, tp, port, Path(draft_dir), Path(target_dir), target_spec, contexts, steps, faults)
        torch.save(runs, path)
    except BaseException as exc:   # one line back to the parent: SGLang's own words and where
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        torch.save(f"{type(exc).__name__}: {text} (at {where})", path)


def _rank_runtime(rank: int, tp: int, port: int) -> dict:
    """SGLang's distributed runtime for this rank (see the module docstring for the two adjustments)."""
    from conformance.adapters.sglang import runtime

    os.environ["SGLANG_NCCL_SO_PATH"] = runtime.NO_NCCL
    torch.set_num_threads(1)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    adjustments = runtime.cpu_runtime_adjustments()
    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu", attention_backend=runtime.ATTENTION_BACKEND,
                       tp_size=tp, ep_size=1, pp_size=1), role="scheduler", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    # The adapter's load() and the target read this instead of setting up a world of one.
    runtime._RUNTIME = {"adjustments": adjustments, "distributed": f"gloo, world {tp}, rank {rank}", "device": "cpu"}
    return runtime._RUNTIME


def _shard_dims(model) -> dict[str, int | None]:
    """The dim SGLang's parallel layers shard each parameter on (their own `output_dim`/`input_dim`)."""
    dims = {}
    for name, p in model.named_parameters():
        if getattr(p, "output_dim", None) is not None:
            dims[name] = p.output_dim
        elif getattr(p, "input_dim", None) is not None:
            dims[name] = p.input_dim
        else:
            dims[name] = None
    return dims


def _rank(adapter, rank, tp, port, draft_dir, target_dir, target_spec, contexts, steps, faults) -> list[RankRun]:
    """This rank's run of every scenario (a fault, or None): loaded once, each fault applied and undone."""
    _rank_runtime(rank, tp, port)
    from safetensors.torch import load_file
    from sglang.srt.distributed.parallel_state import get_tp_group

    from conformance.adapters.sglang.target import AuxIds, load_target, sglang_aux_layer_ids
    from fixtures.targets import TARGETS_BY_ID

    target = load_target(TARGETS_BY_ID[target_spec], target_dir, load_file(str(target_dir / "model.safetensors")))
    aux_ids = sglang_aux_layer_ids(draft_dir)
    loaded = adapter().load(draft_dir, torch.float32)
    draft = loaded.model
    own_embed = draft.model.embed_tokens.weight
    as_loaded = {n: digest(p) for n, p in draft.named_parameters()}
    runs = []
    for fault in faults:
        start = time.perf_counter()
        mine = fault.kind if fault is not None and fault.rank == rank else None
        target.set_capture(AuxIds(aux_ids.use_aux, tuple(i + 1 for i in aux_ids.layer_ids))
                           if mine == "aux_ids_shifted" else aux_ids)
        draft.set_embed(target.model.get_embed() if mine == "target_embedding" else own_embed)
        embed, head = draft.model.embed_tokens, draft.lm_head
        settings = {
            "tp_rank": get_tp_group().rank_in_group, "tp_size": get_tp_group().world_size,
            "attention heads on this rank": loaded.num_heads, "kv heads on this rank": loaded.num_kv_heads,
            "embedding rows (target vocabulary)": [embed.shard_indices.org_vocab_start_index,
                                                   embed.shard_indices.org_vocab_end_index],
            "lm_head rows (draft vocabulary)": [head.shard_indices.org_vocab_start_index,
                                                head.shard_indices.org_vocab_end_index],
            "aux layer ids captured": list(target.layers_to_capture),
        }
        run = RankRun(rank, tp, settings, {n: p.detach().clone() for n, p in draft.named_parameters()},
                      _shard_dims(draft), dict(as_loaded))
        if loaded.hot_token_id is not None:
            run.weights[HOT] = loaded.hot_token_id.clone()
            run.shard_dims[HOT] = None
            run.as_loaded[HOT] = digest(loaded.hot_token_id)
        run.rounds = [_round(target, loaded, context, steps) for context in contexts]
        run.seconds = time.perf_counter() - start
        runs.append(run)
    return runs


def _round(target, loaded, context: list[int], steps: int) -> RankRound:
    """One round: the target's aux states of the context, then the draft EXTEND and DECODE steps. The EXTEND
    pairs every context token's aux with the next token (the target's own greedy token after the last), as
    the EAGLE worker hands them over after a verify; steps >= 1 feed the draft's own d2t-mapped argmax."""
    from reference.eagle3 import DraftBatch

    ids = torch.tensor(context)
    aux, logits = target.run(ids)
    nxt = logits.argmax(-1).view(1)
    input_ids = torch.cat([ids[1:], nxt])
    batch = DraftBatch(aux=aux, input_ids=input_ids, positions=torch.arange(len(context)),
                       seq_ids=torch.zeros(len(context), dtype=torch.long), next_ids=None)
    trace = loaded.run(batch, steps).on_cpu()
    return RankRound(list(context), input_ids.tolist(), aux, trace, [int(s["target_ids"][-1]) for s in trace.steps])


def gather_heads(ranks: list[RankRun], r: int, step: int, stage: str) -> torch.Tensor:
    """The full-width tensor of a head-sharded stage: every rank's heads in rank order (SGLang's QKV and
    row-parallel layers give rank i the i-th block of heads)."""
    base = stage.rsplit(".", 1)[-1]
    return torch.cat([run.rounds[r].trace.steps[step][stage] for run in ranks], dim=HEAD_SHARDED[base])


def gathered_trace(ranks: list[RankRun], r: int):
    """Rank 0's trace of round r with every head-sharded stage gathered across ranks: what TP 1 computes."""
    import copy

    trace = copy.copy(ranks[0].rounds[r].trace)
    trace.steps = [{stage: (gather_heads(ranks, r, k, stage) if stage.rsplit(".", 1)[-1] in HEAD_SHARDED
                            else value) for stage, value in step.items()} for k, step in enumerate(trace.steps)]
    return trace
