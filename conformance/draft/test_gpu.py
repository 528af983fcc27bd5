"""The gpu lane: speculators and SGLang on CUDA at real draft shapes, in bf16, against the reference.

Same checks as the cpu lane (step 0, then teacher-forced draft steps), on the Llama-3.1-8B and
Kimi-K2.5 EAGLE-3 shapes (fixtures/real_shapes.py): SGLang with its own CUDA kernels and the Triton
attention backend, speculators with its flex attention (torch.compile'd on CUDA), the reference on
the same GPU; traces are compared on the CPU. Skipped without CUDA; `--require-gpu` makes that an error.
"""
from __future__ import annotations

import pytest

from conformance.adapters import IMPLEMENTATIONS
from conformance.session.harness import DraftStore, assert_conforms, conformance_params
from fixtures.cases import DraftCase
from fixtures.real_shapes import KIMI_K25, LLAMA31_8B

pytestmark = pytest.mark.gpu

# Two sequences of different lengths; T = 384 is a multiple of 128, which speculators' flex
# attention block mask assumes (speculators models/eagle3/attention.py:37-112).
LENGTHS = (200, 184)
GPU_CASES: tuple[DraftCase, ...] = (
    DraftCase("llama31_8b", tuple(LLAMA31_8B.items()), lengths=LENGTHS,
              summary="Llama-3.1-8B EAGLE-3 draft: hidden 4096, 32/8 heads, vocab 128256 -> 32000"),
    DraftCase("kimi_k25", tuple(KIMI_K25.items()), lengths=LENGTHS,
              summary="Kimi-K2.5 EAGLE-3 draft: hidden 7168, 64/64 heads, head_dim 128, vocab 163840 -> 32000"),
)
STEPS = 3   # step 0 (SGLang EXTEND) and two draft steps (SGLang DECODE / training TTT steps)


@pytest.fixture(scope="session")
def gpu_drafts(tmp_path_factory) -> DraftStore:
    return DraftStore(tmp_path_factory.mktemp("gpu-checkpoints"), device="cuda")


@pytest.mark.parametrize("impl,dtype_name,case", list(conformance_params(IMPLEMENTATIONS, ("bf16",), GPU_CASES)))
def test_real_shape_step0_matches_reference(impl, dtype_name, case, gpu_drafts, report, request, repro):
    assert_conforms(gpu_drafts, report, impl, case, dtype_name, request.node.nodeid, repro)


@pytest.mark.parametrize("impl,dtype_name,case",
                         list(conformance_params(IMPLEMENTATIONS, ("bf16",), GPU_CASES, extra_id=f"k{STEPS}")))
def test_real_shape_draft_steps_match_reference(impl, dtype_name, case, gpu_drafts, report, request, repro):
    assert_conforms(gpu_drafts, report, impl, case, dtype_name, request.node.nodeid, repro, steps=STEPS)
