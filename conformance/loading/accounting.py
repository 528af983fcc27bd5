"""Strict weight accounting: where each checkpoint tensor landed in each implementation, and what not.

Each implementation loads the checkpoint through its adapter (its own loading path), and the adapter
accounts for every tensor (`account`; e.g. SGLang's `load_weights` replayed with every parameter's
`weight_loader` observed, speculators' transformers loader checked by name and value). Here: the
shared Accounting record, the checks every accountant uses (every landed tensor is verified bit for
bit against the checkpoint, after the cast), the d2t/t2d invariants, the knobs observed by running
the loaded draft, and the knob table.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance.core.common import first_line
from conformance.core.tolerances import dtype_name
from conformance.checkpoints import read_weights
from reference.eagle3 import DraftBatch


@dataclass
class Accounting:
    """One implementation's account of one checkpoint."""

    impl: str
    tensors: int = 0                                              # tensors in the checkpoint
    landed: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint tensor, parameter[rows])
    never_loaded: list[str] = field(default_factory=list)        # parameters no checkpoint tensor reached
    dropped: list[str] = field(default_factory=list)             # checkpoint tensors that reached nothing, silently
    ignored: list[str] = field(default_factory=list)             # skipped on purpose by the loader's own code
    differs: list[str] = field(default_factory=list)             # landed, but not bit-equal to the checkpoint
    nan: list[str] = field(default_factory=list)                 # parameters holding NaN/inf after loading
    refused: str = ""                                            # the loader raised (one line)
    vocab_map: list[str] = field(default_factory=list)           # broken d2t/t2d invariants of the checkpoint
    uses: dict[str, str] = field(default_factory=dict)           # lm_head / embed_tokens / d2t: what it really uses
    knobs: dict[str, object] = field(default_factory=dict)       # effective knob values

    @property
    def problems(self) -> list[str]:
        out = [f"refused: {self.refused}"] if self.refused else []
        out += [f"dropped silently: {k}" for k in self.dropped]
        out += [f"never loaded: {p}" for p in self.never_loaded]
        out += [f"differs from checkpoint: {p}" for p in self.differs]
        out += [f"NaN/inf after loading: {p}" for p in self.nan]
        out += [f"invalid {p}" for p in self.vocab_map]
        return out

    def land(self, ckpt_name: str, where: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
        """Checkpoint tensor `ckpt_name` reached `where` (a parameter, or rows of one): verified by value."""
        self.landed.append((ckpt_name, where))
        if not _equal(param, tensor):
            self.differs.append(where)

    def land_rows(self, ckpt_name: str, pname: str, param: torch.Tensor, rows, tensor: torch.Tensor) -> None:
        """`ckpt_name` reached parameter `pname`, or only its rows [start, end) of a fused one (`rows`)."""
        if rows is None:
            self.land(ckpt_name, pname, param, tensor)
        else:
            self.land(ckpt_name, f"{pname}[{rows[0]}:{rows[1]}]", param[rows[0]:rows[1]], tensor)

    def land_by_name(self, ckpt: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                     training_only: frozenset[str] = frozenset()) -> None:
        """For a loader that keys parameters by name: each checkpoint tensor landed on the parameter of its name
        (verified by value) or dropped; then the parameters no tensor filled and those not finite, besides
        `training_only` ones that a draft checkpoint does not carry."""
        for name in sorted(ckpt):
            if name in state:
                self.land(name, name, state[name], ckpt[name])
            else:
                self.dropped.append(name)
        self.never_loaded = sorted(set(state) - set(ckpt) - training_only)
        self.nan = sorted(k for k, v in state.items() if k not in training_only and not finite(v))

    def refuse(self, exc: BaseException, ckpt_dir: Path) -> "Accounting":
        """The loader raised: its own words, one line; nothing else to account for."""
        self.refused = one_line(exc, ckpt_dir)
        self.knobs = {"loaded": "no"}
        return self

    def row(self, draft: str) -> dict:
        """One report row (report.add_row("weight accounting", ...))."""
        return {"draft": draft, "impl": self.impl, "landed": f"{len(self.landed)}/{self.tensors}",
                "problems": "; ".join(self.problems) or "none",
                "d2t/t2d invariants": "broken" if self.vocab_map else "hold",
                "ignored": ", ".join(self.ignored), **{k: v for k, v in self.uses.items()}}


def checkpoint_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor under the name it is stored under, from whichever weight files the directory has (one
    model.safetensors, or shards behind an index as NeMo's checkpointer writes them)."""
    return read_weights(Path(ckpt_dir), stored_names=True)


def _equal(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Bit equality after the loader's cast; a param padded with extra rows (vocab padding) compares its head."""
    if param.shape != tensor.shape and param.dim() == tensor.dim() and param.shape[1:] == tensor.shape[1:] \
            and param.shape[0] > tensor.shape[0]:
        param = param[: tensor.shape[0]]
    return param.shape == tensor.shape and torch.equal(param.detach().cpu(), tensor.to(param.dtype))


def load_and_count(impl: str, ckpt_dir: Path, load: Callable[[], object]) -> tuple[Accounting, dict, object | None]:
    """An accounting begun: the checkpoint's tensors counted and `load()` run; the loaded draft, or None when
    the loader raised (then the accounting holds its refusal, in its own words, and nothing else)."""
    acct = Accounting(impl)
    ckpt = checkpoint_tensors(ckpt_dir)
    acct.tensors = len(ckpt)
    try:
        return acct, ckpt, load()
    except Exception as exc:   # the loader's own words, one line
        acct.refuse(exc, ckpt_dir)
        return acct, ckpt, None


def one_line(exc: BaseException, ckpt_dir: Path) -> str:
    """The loader's own first line, with the temp directory cut down to its name (reports stay identical)."""
    line = first_line(exc)
    return line.replace(str(ckpt_dir), ckpt_dir.name)


def finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


# ---------------------------------------------------------------- d2t / t2d

def vocab_map_problems(tensors: dict[str, torch.Tensor], vocab_size: int,
                       draft_vocab_size: int) -> list[tuple[str, str]]:
    """(tensor, problem) for every broken d2t/t2d invariant (semantics R11; speculators model.py:48-55).

    d2t holds offsets: target = draft + d2t[draft]; the targets are in range, strictly increasing
    (the draft vocabulary in ascending target order), and exactly the True entries of t2d.
    """
    V, Vd = vocab_size, draft_vocab_size
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    out: list[tuple[str, str]] = []
    if Vd < V:
        for name, t in (("d2t", d2t), ("t2d", t2d)):
            if t is None:
                out.append((name, f"missing although draft_vocab_size {Vd} < vocab_size {V}: draft ids cannot be "
                                  "mapped to target ids"))
    if d2t is not None:
        if d2t.dtype != torch.int64:
            out.append(("d2t", f"dtype {dtype_name(d2t.dtype)}, expected int64 (speculators model.py:51-55)"))
        elif tuple(d2t.shape) != (Vd,):
            out.append(("d2t", f"shape {tuple(d2t.shape)}, expected ({Vd},) (draft_vocab_size)"))
        elif Vd < V and not bool(d2t.any()):
            out.append(("d2t", "all zero with draft_vocab_size < vocab_size: the untrained default buffer "
                               "(SpecForge llama3_eagle.py:1696-1699), draft id i would mean target id i"))
        else:
            target = torch.arange(Vd) + d2t
            bad = ((target < 0) | (target >= V)).nonzero().flatten()
            if bad.numel():
                i = int(bad[0])
                out.append(("d2t", f"draft id {i} maps to target id {int(target[i])}, outside [0, {V})"))
            elif Vd > 1 and not bool((target[1:] > target[:-1]).all()):
                i = int((target[1:] <= target[:-1]).nonzero()[0])
                out.append(("d2t", f"target ids not strictly increasing: draft {i} -> {int(target[i])}, "
                                   f"draft {i + 1} -> {int(target[i + 1])}"))
            elif t2d is not None and t2d.dtype == torch.bool and tuple(t2d.shape) == (V,):
                if int(t2d.sum()) != Vd:
                    out.append(("t2d", f"{int(t2d.sum())} True entries, expected draft_vocab_size {Vd}"))
                elif not torch.equal(t2d.nonzero().flatten(), target):
                    i = int((t2d.nonzero().flatten() != target).nonzero()[0])
                    out.append(("t2d", f"disagrees with d2t: draft id {i} maps to {int(target[i])}, t2d's "
                                       f"{i}-th entry is {int(t2d.nonzero().flatten()[i])}"))
    if t2d is not None:
        if t2d.dtype != torch.bool:
            out.append(("t2d", f"dtype {dtype_name(t2d.dtype)}, expected bool (speculators model.py:51-55)"))
        elif tuple(t2d.shape) != (V,):
            out.append(("t2d", f"shape {tuple(t2d.shape)}, expected ({V},) (vocab_size)"))
    return out


def vocab_map(ckpt: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int) -> list[str]:
    """The invariants for the vocabulary sizes the implementation itself built."""
    return [f"{name}: {problem}" for name, problem in vocab_map_problems(ckpt, vocab_size, draft_vocab_size)]


# ---------------------------------------------------------------- per implementation

def rope_text(kind: str, theta) -> str:
    """One implementation's RoPE as the knob table shows it."""
    return f"{kind}, theta {float(theta):g}"


def mla_text(q_lora_rank, kv_lora_rank, nope, rope, v) -> str:
    """One implementation's MLA attention widths as the knob table shows them (MLA drafts only)."""
    return f"q_lora {q_lora_rank or 'none'}, kv_lora {kv_lora_rank}, nope/rope/v {nope}/{rope}/{v}"


# ---------------------------------------------------------------- knobs

PROBE_LENGTHS = (3, 4)   # the probe batch: two short sequences
OBSERVED = ("fc", "norm_before_residual", "layers >= 1 pre-norm")
SAME = 1e-3              # relative difference below which two observed tensors are the same (fp32 rounding: ~1e-6)


def observed_knobs(loaded, aux_width: int, vocab_size: int, ckpt: dict[str, torch.Tensor],
                   params: dict[str, torch.Tensor]) -> dict[str, object]:
    """The knobs no attribute of a built model states, read off one recorded step of the loaded draft
    (`loaded.run`, its canonical stages) on a seeded probe batch: whether fc ran, what layer 0 adds
    attention to (post_attn - attn_out: the raw hidden, or the normed one), and which weights
    normalise the input of layer 1 (the per-column scale from its normed input to its hidden_norm
    stage, matched to the checkpoint's tensors, else to the model's own `params`)."""
    g = torch.Generator().manual_seed(0)
    T = sum(PROBE_LENGTHS)
    batch = DraftBatch(aux=torch.randn(T, aux_width, generator=g),
                       input_ids=torch.randint(0, vocab_size, (T,), generator=g),
                       positions=torch.cat([torch.arange(n) for n in PROBE_LENGTHS]),
                       seq_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(PROBE_LENGTHS)]))
    try:
        trace = loaded.run(batch, 1).on_cpu()
    except Exception as exc:   # the implementation's own words, one line
        return dict.fromkeys(OBSERVED, f"not observed: {first_line(exc)}")

    def stage(name: str) -> torch.Tensor | None:
        got = trace.get(0, name)
        return None if got is None else got[0].detach().double().reshape(T, -1)

    fc_out = stage("fc_out")
    knobs: dict[str, object] = {"fc": "runs at step 0" if fc_out is not None else "NOT RUN at step 0"}
    raw = fc_out if fc_out is not None else stage("aux_in")
    post, attn, normed = stage("layers.0.post_attn"), stage("layers.0.attn_out"), stage("layers.0.hidden_norm")
    if None in (raw, post, attn, normed):
        knobs["norm_before_residual"] = "not observed: a stage is missing from the trace"
    else:
        residual = post - attn
        to_raw, to_normed = _off(residual, raw), _off(residual, normed)
        knobs["norm_before_residual"] = (
            False if to_raw < SAME <= to_normed else True if to_normed < SAME <= to_raw
            else f"neither: {to_raw:.2g} from the raw hidden, {to_normed:.2g} from the normed")
    layer_in, out = stage("layers.0.layer_out"), stage("layers.1.hidden_norm")
    if trace.num_layers < 2:
        knobs["layers >= 1 pre-norm"] = "-"
    elif layer_in is None or out is None:
        knobs["layers >= 1 pre-norm"] = "not observed: a stage is missing from the trace"
    else:
        n = layer_in * torch.rsqrt(layer_in.pow(2).mean(-1, keepdim=True) + 1e-6)
        weight = (out * n).sum(0) / n.pow(2).sum(0)   # per column, least squares
        knobs["layers >= 1 pre-norm"] = _which(weight, ckpt, params)
    return knobs


def _off(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if a.shape == b.shape else float("inf")


def _which(weight: torch.Tensor, ckpt: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> str:
    """The checkpoint tensors equal to `weight`, else the model's own parameters, by name."""
    def matches(tensors):
        return [name.removeprefix("model.") for name, t in sorted(tensors.items())
                if t.dim() == 1 and t.is_floating_point() and _off(weight, t.detach().cpu().double()) < SAME]
    found = matches(ckpt)
    if found:
        return " = ".join(found)
    own = matches(params)
    return (f"not from the checkpoint: its own {' = '.join(own)}" if own else
            "not from the checkpoint, nor any 1-D parameter of the model")


def knob_rows(draft: str, accounts: list[Accounting], only_disagreements: bool) -> list[dict]:
    """Effective knob values side by side: {"draft", "knob", <impl>: value, ..., "agree"}."""
    names = list(dict.fromkeys(k for a in accounts for k in a.knobs))
    rows = []
    for knob in names:
        values = {a.impl: a.knobs.get(knob, "-") for a in accounts}
        present = [str(v) for a, v in zip(accounts, values.values()) if not a.refused]
        agree = len(set(present)) <= 1
        if only_disagreements and agree:
            continue
        rows.append({"draft": draft, "knob": knob, **{k: str(v) for k, v in values.items()},
                     "agree": "yes" if agree else "NO"})
    return rows
