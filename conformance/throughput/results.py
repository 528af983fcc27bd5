"""Throughput figures and the table the terminal summary prints: tokens/s, roofline fraction, and the
ratio to the reference's figure at the same shape and pass."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from conformance.adapters import REFERENCE
from conformance.throughput.cases import BenchCase


@dataclass
class Figure:
    case: BenchCase
    median_s: float      # of the timed step (for a TTT decode: step 1 alone)
    iqr_s: float
    rounds: int
    weight_bytes: int
    kv_bytes: int
    copy_bw: float

    @property
    def tokens_per_s(self) -> float:
        return self.case.tokens / self.median_s

    @property
    def roofline_fraction(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.median_s / self.copy_bw

    def row(self, reference: "Figure | None") -> dict:
        c = self.case
        measured = self.median_s > 0   # a TTT step 1 (a difference of medians) can drown in noise
        return {"device": c.device, "size": c.size, "dtype": c.dtype, "B": c.batch, "L": c.context,
                "pass": c.pass_, "impl": c.impl, "median ms": round(self.median_s * 1e3, 4),
                "IQR ms": round(self.iqr_s * 1e3, 4), "rounds": self.rounds,
                "tokens/s": round(self.tokens_per_s) if measured else None,
                "MB read": round((self.weight_bytes + self.kv_bytes) / 1e6, 3),
                "roofline": float(f"{self.roofline_fraction:.3g}") if measured else None,
                "vs reference": round(self.median_s / reference.median_s, 3)
                if measured and reference is not None and reference.median_s > 0 else None}


@dataclass
class Results:
    figures: dict[str, Figure] = field(default_factory=dict)      # by BenchCase.id

    def bandwidth(self) -> dict[str, float]:
        """device -> median copy bandwidth over this run's figures."""
        by_device: dict[str, list[float]] = {}
        for fig in self.figures.values():
            by_device.setdefault(fig.case.device, []).append(fig.copy_bw)
        return {d: statistics.median(v) for d, v in by_device.items()}

    def add(self, figure: Figure) -> None:
        self.figures[figure.case.id] = figure

    def rows(self) -> list[dict]:
        out = []
        for fig in self.figures.values():
            ref = self.figures.get(reference_id(fig.case)) if fig.case.impl != REFERENCE else None
            out.append(fig.row(ref))
        return out

    def table(self) -> list[str]:
        rows = self.rows()
        if not rows:
            return []
        cols = list(rows[0])
        widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
        lines = ["copy bandwidth (read + write, this run): "
                 + ", ".join(f"{d} {bw / 1e9:.2f} GB/s" for d, bw in sorted(self.bandwidth().items()))
                 + " (best of 5 copies next to each figure, median over figures)",
                 "roofline = (bytes of weights and K/V read) / step time / copy bandwidth; "
                 "vs reference = step time / the reference's at the same shape and pass "
                 "(for SGLang's decode: its B-token DECODE pass vs a B*L-token TTT step)",
                 "  ".join(c.rjust(widths[c]) for c in cols)]
        lines += ["  ".join(_fmt(r[c]).rjust(widths[c]) for c in cols) for r in rows]
        return lines


def reference_id(case: BenchCase) -> str:
    """The id of the reference's figure at the same shape and pass."""
    return case.id.rsplit("-", 1)[0] + "-" + REFERENCE


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) and (abs(v) < 1e-2 or abs(v) >= 1e5) else str(v))


RESULTS = Results()
