"""One throughput figure's coordinates: shape, dtype, device, batch, context, pass and implementation."""
from __future__ import annotations

from dataclasses import dataclass

from conformance.adapters import ADAPTERS
from fixtures.real_shapes import SHAPES
from fixtures.tiny import make_config
from reference.eagle3 import Eagle3Config

# The timed passes: step 0 (EXTEND) and step 1 (DECODE); what each adapter times is its
# `timed_pass` (stage hooks off in every case).
EXTEND, DECODE = "extend", "decode"


@dataclass(frozen=True)
class BenchCase:
    size: str          # a key of fixtures.real_shapes.SHAPES
    dtype: str         # "fp32" | "bf16"
    device: str        # "cpu" | "cuda"
    batch: int         # B requests (packed sequences)
    context: int       # L tokens each
    pass_: str         # EXTEND | DECODE
    impl: str          # adapter name
    lane: str = "cpu"  # the sweep it belongs to: the default lane's, or a lane of its own (vLLM's)

    @property
    def id(self) -> str:
        return f"{self.device}-{self.size}-{self.dtype}-b{self.batch}-l{self.context}-{self.pass_}-{self.impl}"

    @property
    def config(self) -> Eagle3Config:
        return make_config(**SHAPES[self.size])

    @property
    def step(self) -> int:
        return 0 if self.pass_ == EXTEND else 1

    @property
    def tokens(self) -> int:
        """Query tokens of the timed step: all B*L, except a serving decode (one per request)."""
        return self.batch if ADAPTERS[self.impl].serving_decode and self.step > 0 else self.batch * self.context
