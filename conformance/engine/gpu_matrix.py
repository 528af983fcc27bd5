"""The CUDA engine lane's configurations (conformance/engine/test_engine_gpu.py), as data: attention backend x CUDA
graphs x overlap scheduler x page size, each mapped onto SGLang 0.5.23's own ServerArgs fields.

The fields, where SGLang declares them (sglang/srt/...):
| field                    | declared                           | what it selects                                    |
|--------------------------|------------------------------------|----------------------------------------------------|
| attention_backend        | arg_groups/fields/exec_.py:207     | the kernels of target and draft attention; choices |
|                          |                                    | arg_groups/choices.py:69 (and the draft's, :103)   |
| disable_cuda_graph       | arg_groups/fields/exec_.py:670     | the legacy global switch (keyword only, no CLI     |
|                          |                                    | flag): both phases' graphs off,                    |
|                          |                                    | arg_groups/cuda_graph_hook.py:55-57                |
| disable_overlap_schedule | arg_groups/fields/schedule.py:193  | the overlap scheduler (spec v2 overlaps the CPU    |
|                          |                                    | scheduler with the GPU worker) off                 |
| page_size                | arg_groups/fields/schedule.py:143  | tokens per KV page                                 |
| dtype                    | arg_groups/fields/model.py:160     | weights and activations                            |

Each configuration's eager twin is the same backend and dtype with CUDA graphs off, the overlap scheduler off and
page size 1: the run every other configuration of that backend must equal token for token.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

# Backend -> the dtype it serves in. FA3's and FlashInfer's attention kernels take fp16/bf16 only (neither
# package is installed on the hosts this suite is tested on, so this is their documentation's word, not a run);
# Triton's backend serves fp32, where the reference's simulation is exact.
BACKENDS = {"triton": "float32", "fa3": "bfloat16", "flashinfer": "bfloat16"}
PAGE_SIZES = (1, 16)


@dataclass(frozen=True)
class GpuConfig:
    backend: str          # attention_backend (target and draft: SGLang uses it for both unless told otherwise)
    cuda_graph: bool      # CUDA graphs captured and replayed (not disable_cuda_graph)
    overlap: bool         # the overlap scheduler (not disable_overlap_schedule)
    page_size: int        # page_size

    @property
    def dtype(self) -> str:
        return BACKENDS[self.backend]

    @property
    def id(self) -> str:
        """e.g. `fa3-graph-overlap-page16`, `triton-eager-sync-page1`."""
        return "-".join((self.backend, "graph" if self.cuda_graph else "eager",
                         "overlap" if self.overlap else "sync", f"page{self.page_size}"))

    def server_args(self) -> dict:
        """The ServerArgs keywords this configuration sets (beside engine_cuda.BASE_ARGS and a group's own)."""
        return dict(attention_backend=self.backend, disable_cuda_graph=not self.cuda_graph,
                    disable_overlap_schedule=not self.overlap, page_size=self.page_size, dtype=self.dtype)

    @property
    def eager_twin(self) -> "GpuConfig":
        """The run this one must equal token for token: same backend, eager, no overlap, page size 1."""
        return GpuConfig(self.backend, cuda_graph=False, overlap=False, page_size=1)

    @property
    def is_eager_twin(self) -> bool:
        return self == self.eager_twin

    def unavailable(self, capability: tuple[int, int]) -> str | None:
        """Why this GPU (its compute capability) cannot serve the configuration, in one line, or None."""
        major = capability[0]
        # SGLang's own gate for FA3 on a non-MLA model (layers/attention/attention_registry.py:241-247).
        if self.backend == "fa3" and major not in (8, 9):
            return (f"engine gpu: {self.id}: SGLang's FA3 backend needs compute capability 8.x or 9.x "
                    f"(attention_registry.py:241-247), this GPU is {capability[0]}.{capability[1]}")
        return None


MATRIX = tuple(GpuConfig(backend, graph, overlap, page)
               for backend, graph, overlap, page in itertools.product(BACKENDS, (False, True), (False, True),
                                                                      PAGE_SIZES))
BY_ID = {c.id: c for c in MATRIX}


def server_args_problems(args: dict) -> list[str]:
    """What SGLang's own ServerArgs refuses in `args`, one line each: a keyword that is not a field, a value of the
    wrong type (msgspec's conversion, the struct's own annotations) or an attention backend outside SGLang's choices.
    Constructs the record only; nothing is resolved, no device is touched."""
    import msgspec
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.server_args import ServerArgs

    fields = {f.name: f for f in msgspec.structs.fields(ServerArgs)}
    problems = [f"`{k}` is not a ServerArgs field" for k in args if k not in fields]
    if problems:
        return problems
    for name, value in args.items():   # field by field: some other fields' annotations are beyond msgspec.convert
        try:
            msgspec.convert(value, fields[name].type, strict=True)
        except msgspec.ValidationError as exc:
            problems.append(f"ServerArgs refuses `{name}={value!r}`: {exc}")
    if not problems:   # SGLang's own constructor takes them (it resolves nothing until resolve_once)
        record = ServerArgs(model_path="unused", **args)
        problems += [f"ServerArgs holds `{k}={getattr(record, k)!r}`, given {v!r}" for k, v in args.items()
                     if getattr(record, k) != v]
    backend = args.get("attention_backend")
    if backend is not None:
        for name, choices in (("attention", ATTENTION_BACKEND_CHOICES),
                              ("draft attention", DRAFT_ATTENTION_BACKEND_CHOICES)):
            if backend not in choices:
                problems.append(f"attention_backend `{backend}` is not one of SGLang's {name} backends {choices}")
    return problems
