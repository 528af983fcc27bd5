"""Strict weight accounting: where each checkpoint tensor landed in each implementation, and what not.

Each implementation loads the checkpoint through its adapter (its own loading path); then SGLang's
`load_weights` is replayed once more with every parameter's `weight_loader` wrapped (observation
only: the wrapper records the call and forwards it), which says which checkpoint tensor reached
which parameter (and which shard of a fused one); speculators' transformers loader is checked by
comparing values. Every landed tensor is verified bit for bit against the checkpoint, after the cast.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.adapters import ADAPTERS
from fixtures.checkpoint import WEIGHTS_FILE
from reference.eagle3 import Eagle3Config


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

    def row(self, draft: str) -> dict:
        """One report row (report.add_row("weight accounting", ...))."""
        return {"draft": draft, "impl": self.impl, "landed": f"{len(self.landed)}/{self.tensors}",
                "problems": "; ".join(self.problems) or "none",
                "d2t/t2d invariants": "broken" if self.vocab_map else "hold",
                "ignored": ", ".join(self.ignored), **{k: v for k, v in self.uses.items()}}


def checkpoint_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(ckpt_dir) / WEIGHTS_FILE), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _equal(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Bit equality after the loader's cast; a param padded with extra rows (vocab padding) compares its head."""
    if param.shape != tensor.shape and param.dim() == tensor.dim() and param.shape[1:] == tensor.shape[1:] \
            and param.shape[0] > tensor.shape[0]:
        param = param[: tensor.shape[0]]
    return param.shape == tensor.shape and torch.equal(param.detach().cpu(), tensor.to(param.dtype))


def _one_line(exc: BaseException, ckpt_dir: Path) -> str:
    """The loader's own first line, with the temp directory cut down to its name (reports stay identical)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line.replace(str(ckpt_dir), ckpt_dir.name)


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


# ---------------------------------------------------------------- d2t / t2d

def vocab_map_problems(tensors: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int) -> list[tuple[str, str]]:
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
            out.append(("d2t", f"dtype {str(d2t.dtype).replace('torch.', '')}, expected int64 (speculators model.py:51-55)"))
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
            out.append(("t2d", f"dtype {str(t2d.dtype).replace('torch.', '')}, expected bool (speculators model.py:51-55)"))
        elif tuple(t2d.shape) != (V,):
            out.append(("t2d", f"shape {tuple(t2d.shape)}, expected ({V},) (vocab_size)"))
    return out


def _vocab_map(ckpt: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int) -> list[str]:
    """The invariants for the vocabulary sizes the implementation itself built."""
    return [f"{name}: {problem}" for name, problem in vocab_map_problems(ckpt, vocab_size, draft_vocab_size)]


# ---------------------------------------------------------------- per implementation

def account(impl: str, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
    """Load `ckpt_dir` (in `impl`'s own format) through `impl`'s adapter and account for every tensor.

    `target`: the target's config (hidden_size, vocab_size), when known, for what SGLang serves with.
    """
    return {"reference": _reference, "speculators": _speculators, "sglang": _sglang}[impl](Path(ckpt_dir), dtype, target)


def _reference(ckpt_dir: Path, dtype: torch.dtype, target) -> Accounting:
    """The reference reads tensors by name; a recording dict lists the ones one forward really reads."""
    from fixtures.tiny import make_batch

    acct = Accounting("reference")
    ckpt = checkpoint_tensors(ckpt_dir)
    acct.tensors = len(ckpt)
    loaded = ADAPTERS["reference"]().load(ckpt_dir, dtype)
    model = loaded.model
    read: set[str] = set()

    class Recording(dict):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            if key in self:
                read.add(key)
            return super().get(key, default)

    model.w = Recording(model.w)
    cfg = model.cfg
    model.run(make_batch(cfg, (3,), torch.Generator().manual_seed(0)), 1)
    for name in sorted(ckpt):
        if name in read:
            acct.landed.append((name, name))
            if not _equal(model.w[name], ckpt[name]):
                acct.differs.append(name)
        elif name not in ("t2d",):   # t2d is implied by d2t; the reference maps ids with d2t only
            acct.dropped.append(name)
        else:
            acct.ignored.append(name)
    acct.uses = {"embed_tokens": "checkpoint" if "embed_tokens.weight" in read else "absent",
                 "lm_head": "embed_tokens (tied)" if cfg.tie_word_embeddings else "checkpoint lm_head",
                 "d2t": "checkpoint d2t" if "d2t" in read else "none (draft vocab = vocab)"}
    acct.knobs = reference_knobs(cfg)
    acct.vocab_map = _vocab_map(ckpt, cfg.vocab_size, cfg.draft_vocab_size)
    return acct


def reference_knobs(cfg: Eagle3Config) -> dict:
    return {
        "aux states x width": f"{cfg.num_aux_hidden_states} x {cfg.target_hidden_size}",
        "fc": f"{cfg.num_aux_hidden_states * cfg.target_hidden_size} -> {cfg.hidden_size}, always",
        "norm_before_fc": cfg.norm_before_fc, "fc_norm": cfg.fc_norm,
        "norm_before_residual": cfg.norm_before_residual, "norm_output": cfg.norm_output,
        "layers": cfg.num_hidden_layers, "heads / kv heads / head_dim":
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}/{cfg.head_dim}",
        "rope": _rope_text((cfg.rope_scaling or {}).get("rope_type", "default"), cfg.rope_theta),
        "q/k/v bias": cfg.attention_bias, "mlp bias": cfg.mlp_bias,
        "sliding window": cfg.sliding_window or "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{cfg.draft_vocab_size}",
        "layers >= 1 pre-norm": "input_layernorm" if cfg.num_hidden_layers > 1 else "-",
    }


def _rope_text(kind: str, theta) -> str:
    return f"{kind}, theta {float(theta):g}"


def _speculators(ckpt_dir: Path, dtype: torch.dtype, target) -> Accounting:
    """speculators' transformers loader keys parameters by name; the adapter's strict check raises on
    any tensor dropped or never loaded, so a refusal names them; success is verified by value."""
    acct = Accounting("speculators")
    ckpt = checkpoint_tensors(ckpt_dir)
    acct.tensors = len(ckpt)
    try:
        loaded = ADAPTERS["speculators"]().load(ckpt_dir, dtype)
    except Exception as exc:   # the loader's own words, one line
        acct.refused = _one_line(exc, ckpt_dir)
        acct.knobs = {"loaded": "no"}
        return acct
    model = loaded.model
    state = model.state_dict()
    for name in sorted(ckpt):
        if name in state:
            acct.landed.append((name, name))
            if not _equal(state[name], ckpt[name]):
                acct.differs.append(name)
        else:
            acct.dropped.append(name)
    from conformance.adapters.speculators import VERIFIER_OWNED
    acct.never_loaded = sorted(set(state) - set(ckpt) - set(VERIFIER_OWNED))   # the teacher head is training-only
    acct.nan = sorted(k for k, v in state.items() if k not in VERIFIER_OWNED and not _finite(v))
    cfg = model.config
    acct.vocab_map = _vocab_map(ckpt, model.embed_tokens.num_embeddings, model.lm_head.out_features)
    acct.uses = {"embed_tokens": "checkpoint (in training: the verifier's, unless embed_requires_grad)",
                 "lm_head": "checkpoint lm_head (in training: verifier lm_head[t2d], frozen; model.py:172-185)",
                 "d2t": "checkpoint d2t" if model.d2t is not None else "none (draft vocab = vocab)"}
    tl = cfg.transformer_layer_config
    layer0 = model.layers[0]
    rope = model.rotary_emb
    acct.knobs = {
        "aux states x width": f"{model.fc.in_features // tl.hidden_size} x {tl.hidden_size}",
        "fc": f"{model.fc.in_features} -> {model.fc.out_features}, always",
        "norm_before_fc": model.input_norm is not None, "fc_norm": model.fc_norm is not None,
        "norm_before_residual": bool(getattr(layer0, "norm_before_residual", cfg.norm_before_residual)),
        "norm_output": bool(cfg.norm_output),
        "layers": len(model.layers),
        "heads / kv heads / head_dim": f"{tl.num_attention_heads}/{tl.num_key_value_heads}/{tl.head_dim}",
        "rope": _rope_text(rope.rope_type, rope.config.rope_parameters.get("rope_theta", 10000.0)),
        "q/k/v bias": layer0.self_attn.q_proj.bias is not None,
        "mlp bias": layer0.mlp.gate_proj.bias is not None,
        "sliding window": model.sliding_window if model.uses_sliding_window_attn else "none",
        "vocab / draft vocab": f"{model.embed_tokens.num_embeddings}/{model.lm_head.out_features}",
        "layers >= 1 pre-norm": "input_layernorm" if len(model.layers) > 1 else "-",
    }
    return acct


_SGLANG_ROPE = {"RotaryEmbedding": "default", "LinearScalingRotaryEmbedding": "linear",
                "Llama3RotaryEmbedding": "llama3", "YaRNScalingRotaryEmbedding": "yarn",
                "DeepseekScalingRotaryEmbedding": "deepseek_yarn"}


def _sglang(ckpt_dir: Path, dtype: torch.dtype, target) -> Accounting:
    from sglang.srt.model_loader.weight_utils import default_weight_loader, safetensors_weights_iterator

    acct = Accounting("sglang")
    ckpt = checkpoint_tensors(ckpt_dir)
    acct.tensors = len(ckpt)
    try:
        loaded = ADAPTERS["sglang"]().load(ckpt_dir, dtype)
    except Exception as exc:
        acct.refused = _one_line(exc, ckpt_dir)
        acct.knobs = {"loaded": "no"}
        return acct
    model = loaded.model
    params = dict(model.named_parameters())
    calls: list[tuple[str, str, object]] = []   # (checkpoint tensor, parameter, shard id)
    current: list[str] = [""]

    def recording(pname, loader):
        def weight_loader(param, loaded_weight, *args):
            calls.append((current[0], pname, args[0] if args else None))
            return loader(param, loaded_weight, *args)
        return weight_loader

    had = {name: "weight_loader" in vars(p) for name, p in params.items()}
    originals = {name: getattr(p, "weight_loader", default_weight_loader) for name, p in params.items()}
    for name, p in params.items():
        p.weight_loader = recording(name, originals[name])

    def named_weights():
        for name, tensor in safetensors_weights_iterator([str(ckpt_dir / WEIGHTS_FILE)]):
            current[0] = name
            yield name, tensor

    try:   # the same load SGLang's adapter just did, observed: values are rewritten with themselves
        model.load_weights(named_weights())
    finally:
        for name, p in params.items():
            if had[name]:
                p.weight_loader = originals[name]
            else:
                del p.weight_loader

    reached = {c for c, _, _ in calls}
    for ckpt_name, pname, shard in calls:
        param, tensor = params[pname], ckpt[ckpt_name]
        rows = _shard_rows(model, pname, shard, param)
        where = pname if rows is None else f"{pname}[{rows[0]}:{rows[1]}]"
        acct.landed.append((ckpt_name, where))
        view = param if rows is None else param[rows[0]:rows[1]]
        if not _equal(view, tensor):
            acct.differs.append(where)
    for name in sorted(ckpt):
        if name in reached:
            continue
        if "d2t" in name:      # becomes hot_token_id = d2t + arange (llama_eagle3.py:349-353)
            hot = model.get_hot_token_id()
            ok = hot is not None and torch.equal(hot.cpu(), ckpt[name] + torch.arange(ckpt[name].shape[0]))
            acct.landed.append((name, "hot_token_id (d2t + arange)"))
            if not ok:
                acct.differs.append("hot_token_id")
        elif "t2d" in name:    # skipped by its own code (llama_eagle3.py:355-356)
            acct.ignored.append(name)
        else:
            acct.dropped.append(name)
    loaded_params = {p for _, p, _ in calls}
    acct.never_loaded = sorted(set(params) - loaded_params)
    acct.nan = sorted(n for n, p in params.items() if not _finite(p))

    inner, cfg = model.model, model.config
    acct.vocab_map = _vocab_map(ckpt, cfg.vocab_size, cfg.draft_vocab_size)
    tied = model.lm_head is inner.embed_tokens
    Ht = inner.hidden_size_in
    H = cfg.hidden_size
    serve_embed = "the target's (set_embed, eagle_worker_v2.py:355-363)" if Ht == H else \
        "its own (target_hidden_size != hidden_size disables set_embed, llama.py:910-916)"
    if target is not None and Ht == H:
        t_vocab, t_hidden = target.get("vocab_size"), target.get("hidden_size")
        if (t_vocab, t_hidden) != (cfg.vocab_size, H):
            serve_embed += f"; MISMATCH: target embedding is [{t_vocab}, {t_hidden}], the draft's [{cfg.vocab_size}, {H}]"
    acct.uses = {
        "embed_tokens": f"checkpoint in this run; in serving {serve_embed}",
        "lm_head": ("embed_tokens (tied; becomes the target's embedding when served)" if tied
                    else "the target's lm_head (no draft_vocab_size, llama_eagle3.py:306-308)" if model.load_lm_head_from_target
                    else "checkpoint lm_head"),
        "d2t": "hot_token_id = d2t + arange" if model.get_hot_token_id() is not None else "none: draft ids used as target ids",
    }
    attn = inner.layers[0].self_attn
    window = attn.attn.sliding_window_size
    acct.knobs = {
        "aux states x width": f"{inner.num_aux_hidden_states} x {Ht}",
        "fc": (f"{inner.fc.in_features} -> {inner.fc.out_features}, "
               + ("always" if inner.num_aux_hidden_states * Ht != H else "NEVER (aux width == hidden_size, :238)")),
        "norm_before_fc": inner.input_norm is not None, "fc_norm": inner.fc_norm is not None,
        "norm_before_residual": False,   # no such path: the residual is always the raw hidden (:97-99)
        "norm_output": bool(inner.norm_output),
        "layers": len(inner.layers),
        "heads / kv heads / head_dim": f"{attn.num_heads}/{attn.num_kv_heads}/{attn.head_dim}",
        "rope": _rope_text(_SGLANG_ROPE.get(type(attn.rotary_emb).__name__, type(attn.rotary_emb).__name__),
                           attn.rotary_emb.base),
        "q/k/v bias": attn.qkv_proj.bias is not None,
        "mlp bias": getattr(inner.layers[0].mlp.gate_up_proj, "bias", None) is not None,
        "sliding window": window if window not in (None, -1) else "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{cfg.draft_vocab_size}",
        "layers >= 1 pre-norm": "hidden_norm (:103-105)" if len(inner.layers) > 1 else "-",
    }
    return acct


def _shard_rows(model, pname: str, shard, param) -> tuple[int, int] | None:
    """Rows of a fused parameter (qkv_proj, gate_up_proj) that one shard fills; None when not fused."""
    if shard is None:
        return None
    module = model.get_submodule(pname.rsplit(".", 1)[0])
    if hasattr(module, "q_proj_shard_size"):   # QKVParallelLinear: [q | k | v]
        q, kv = module.q_proj_shard_size, module.kv_proj_shard_size
        start = {"q": 0, "k": q, "v": q + kv}[shard]
        return start, start + (q if shard == "q" else kv)
    sizes = module.output_sizes                  # MergedColumnParallelLinear: [gate | up]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


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


