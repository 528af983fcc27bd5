"""The engine lane's Triton-interpreter adjustment for bf16 dots (engine_shims.widen_bf16_dot_operands).

SGLang's Triton attention kernels run in Triton's interpreter on this CPU host. The interpreter keeps a bf16
tensor as raw uint16 bits and its tl.dot multiplies the bits, so a bf16 engine served garbage (the tiny target
alone, without a draft: [85, 85, ...] where transformers' bf16 greedy gives [65, 65, ...]). Shown here on one
tl.dot: without the adjustment it is wrong by orders of magnitude (the fault it mends, kept as its plant); with it,
the kernel's product equals the product of the bf16 operands' fp32 values exactly, and an fp32 dot is unchanged.
In a fresh interpreter: TRITON_INTERPRET is read when triton decorates a kernel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conformance.meta.test_verdict import ROOT

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, torch, triton, triton.language as tl
    from conformance.adapters.sglang.engine_shims import widen_bf16_dot_operands

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(c_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    def run(dtype):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(16, 16, generator=g).to(dtype) for _ in range(2))
        c = torch.empty(16, 16, dtype=torch.float32)
        dot[(1,)](a, b, c, 16)
        expected = torch.from_numpy(np.matmul(a.float().numpy(), b.float().numpy()))
        return {"max_abs": (c - expected).abs().max().item(), "equal": torch.equal(c, expected)}

    out = {"bf16 before": run(torch.bfloat16), "fp32 before": run(torch.float32)}
    out["applied"] = widen_bf16_dot_operands()
    out["again"] = widen_bf16_dot_operands()
    out.update({"bf16 after": run(torch.bfloat16), "fp32 after": run(torch.float32)})
    print(json.dumps(out))
""")


def test_bf16_dots_compute_with_their_values():
    ran = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out["bf16 before"]["max_abs"] > 1e3, f"the interpreter's bf16 dot is no longer wrong: {out}"
    assert out["bf16 after"]["equal"], f"bf16 tl.dot after the adjustment: {out}"
    assert out["fp32 before"]["equal"] and out["fp32 after"]["equal"], f"an fp32 dot changed: {out}"
    assert "already" in out["again"] and "already" not in out["applied"], out
