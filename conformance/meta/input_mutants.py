"""Mutants of the verdict's inputs, for the fuzz campaign (conformance/meta/test_fuzz_inputs.py).

A base is one valid set of inputs in a directory: a draft (config.json and its weights, in one of the
formats the verdict reads, or sharded behind model.safetensors.index.json), the JSONL training samples,
their hidden-state dump and a target config. A mutant is a base plus a list of operations, each a tuple of
plain values (so a mutant is printed, stored as a regression example and replayed as it is):

    ("json", file, "set" | "delete" | "add" | "wrap", path, ...)   a JSON file's tree (config, index, target)
    ("jsonl", file, "set" | "delete" | "add", (line, *path), ...)   one JSONL line's object
    ("line", file, "drop" | "copy" | "raw", line, [text])           a JSONL line as text
    ("text", file, "truncate" | "insert" | "replace" | "deep", ...) any file as text
    ("bytes", file, "truncate" | "flip" | "header_length", ...)     a safetensors file's bytes
    ("header", file, "set" | "rename" | "delete" | "metadata", ...) a safetensors header, rewritten
    ("tensor", file, "nonfinite" | "cast" | "reshape" | "drop" | "add" | "rename" | "fill", name, ...)
    ("file", file, "delete" | "empty")

`draw_mutant` draws one with Hypothesis from a base's own structure (its JSON paths, tensor names).
"""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from conformance.checkpoints import INDEX_FILE, WEIGHTS_FILE, write_draft
from conformance.checkpoints.errors import ConversionError
from conformance.checkpoints.formats import WRITABLE, config_json
from conformance.checkpoints.hidden_states import write_dump
from conformance.checkpoints.training_data import load_samples, make_samples, write_samples
from conformance.user.example_draft import EXAMPLE_CONFIG, LENGTHS, PROMPTS, SEED
from fixtures.tiny import make_draft_weights

CONFIG, DATA, DUMP, TARGET = "draft/config.json", "train.jsonl", "hidden_states", "target.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TARGET_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 40,
                 "num_hidden_layers": 8, "vocab_size": 97}


@dataclass(frozen=True)
class Base:
    """One valid set of inputs under `root` (draft/, train.jsonl, hidden_states/, target.json)."""

    id: str
    root: Path
    json_paths: dict[str, tuple[tuple, ...]] = field(default_factory=dict)    # file -> every path in its tree
    tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)         # safetensors file -> its names

    def files(self) -> dict[str, list[str]]:
        """The files a mutation may touch, by kind (paths relative to root)."""
        draft = self.root / "draft"
        weights = sorted(f"draft/{p.name}" for p in draft.glob("*.safetensors"))
        dump = sorted(f"{DUMP}/{p.name}" for p in (self.root / DUMP).glob("*.safetensors"))
        return {"config": [CONFIG], "index": [f"draft/{INDEX_FILE}"] if (draft / INDEX_FILE).is_file() else [],
                "weights": weights, "data": [DATA], "dump": dump, "target": [TARGET]}


# ---------------------------------------------------------------- the bases

def write_bases(root: Path) -> list[Base]:
    """The example inputs (conformance/user/example_draft.py: its draft, samples and target's shape) with the
    draft in every format the verdict reads, the original EAGLE-3 trainer's included, and sharded."""
    first = root / "sglang"
    cfg = EXAMPLE_CONFIG
    weights = make_draft_weights(cfg, torch.Generator().manual_seed(SEED))
    write_draft(cfg, weights, first / "draft", "sglang")
    ids = make_samples(cfg, LENGTHS, torch.Generator().manual_seed(SEED + 4))
    samples = load_samples(write_samples(first / DATA, ids, n_prompt=list(PROMPTS)), cfg.vocab_size)
    # Seeded random aux states: a dump is read for its shapes, ids and finiteness, and the example's own
    # (conformance/user/example_draft.py) would build a transformers target for each run of the fuzz test.
    g = torch.Generator().manual_seed(SEED + 2)
    write_dump(first / DUMP, samples, [torch.randn(len(s.input_ids), cfg.num_aux_hidden_states + 1,
                                                   cfg.target_hidden_size, generator=g) for s in samples])
    (first / TARGET).write_text(json.dumps(TARGET_CONFIG))
    dirs = {"sglang": first}
    # A format whose writer refuses this Llama base by name (sglang-mla: SGLang's MLA draft class only) has no base here
    for fmt in [other_fmt for other_fmt in WRITABLE if other_fmt != "sglang" and expresses(cfg, other_fmt)] + [
            "eagle", "sharded"]:
        out = root / fmt
        shutil.copytree(first, out, ignore=shutil.ignore_patterns("draft"))
        if fmt == "eagle":   # SpecForge's names and config, as the original trainer's LlamaForCausalLM
            write_draft(cfg, weights, out / "draft", "specforge")
            path = out / CONFIG
            path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": ["LlamaForCausalLM"]}))
        elif fmt == "sharded":
            shard(first / "draft", out / "draft")
        else:
            write_draft(cfg, weights, out / "draft", fmt, drop_embed=fmt == "specforge")
        dirs[fmt] = out
    return [describe(name, path) for name, path in dirs.items()]


def expresses(cfg, fmt: str) -> bool:
    try:
        config_json(cfg, fmt)
    except ConversionError:
        return False
    return True


def shard(src: Path, out: Path) -> None:
    """`src`'s tensors in two shards behind model.safetensors.index.json, as transformers shards a checkpoint."""
    out.mkdir(parents=True)
    shutil.copyfile(src / "config.json", out / "config.json")
    with safe_open(str(src / WEIGHTS_FILE), framework="pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    half = len(names) // 2
    weight_map = {}
    for file, part in zip(SHARDS, (names[:half], names[half:])):
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def describe(name: str, root: Path) -> Base:
    base = Base(name, root)
    kinds = base.files()
    for kind in ("config", "index", "target"):
        for file in kinds[kind]:
            base.json_paths[file] = tuple(paths(json.loads((root / file).read_text())))
    rows = [json.loads(line) for line in (root / DATA).read_text().splitlines()]
    base.json_paths[DATA] = tuple((i, *p) for i, row in enumerate(rows) for p in paths(row))
    for file in kinds["weights"] + kinds["dump"]:
        with safe_open(str(root / file), framework="pt") as f:
            base.tensors[file] = tuple(f.keys())
    return base


def paths(node, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON tree (dict keys and list indices), the root's children first."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += paths(value, (*prefix, key))
    return out


# ---------------------------------------------------------------- drawing a mutant

# Keys any of the formats reads, or that mean something to an implementation, to add where they do not belong.
KEYS = ("layer_types", "rope_parameters", "rope_scaling", "rope_theta", "rope_type", "type", "factor",
        "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
        "beta_slow", "mscale", "mscale_all_dim", "truncate", "mrope_section", "partial_rotary_factor",
        "use_sliding_window", "sliding_window", "eagle_config", "eagle_aux_hidden_state_layer_ids", "eagle3",
        "concat_factor", "fc_in_dim", "fc_out_dim", "bias", "use_aux_norm", "target_vocab_size", "draft_vocab_size",
        "num_aux_hidden_states", "target_hidden_size", "embedding_multiplier", "speculators_model_type",
        "speculators_config", "proposal_methods", "verifier", "transformer_layer_config", "text_config",
        "architectures", "model_type", "hidden_act", "head_dim", "num_hidden_layers", "tie_word_embeddings",
        "norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "embed_requires_grad",
        "target_model_type", "weight_map", "metadata", "input_ids", "loss_mask", "seq_len", "n_prompt_tokens",
        "n_response_tokens", "source", "max_position_embeddings", "rms_norm_eps", "vocab_size", "hidden_size")
# RoPE blocks of every type the reference implements, and some it does not, to put where a block goes.
ROPE_BLOCKS = ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0,
               "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, {"type": "mrope", "mrope_section": [2, 2, 2]},
               {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
               {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]})
BLOCKS = ROPE_BLOCKS + ({"eagle_aux_hidden_state_layer_ids": [0, 3, 5], "use_aux_hidden_state": True},
                        {"concat_factor": 3, "fc_in_dim": 120, "fc_out_dim": 40},
                        {"model_type": "qwen3", "hidden_size": 40, "num_attention_heads": 4})
# Sizes a field may be set to: zero, negative, off by one of the example's, and absurd.
SIZES = (0, -1, 1, 2, 3, 4, 12, 39, 40, 41, 61, 96, 97, 98, 120, 2 ** 16, 2 ** 24 + 1, 2 ** 31, 2 ** 63, 10 ** 30)
DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "U16",
          "U32", "U64", "F8_E8M0", "F4", "C64", "f32", "")
CASTS = (torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
         torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
SNIPPETS = ("", "{", "}", "]", ",", '"', "\x00", "\ufffd", "NaN", "-Infinity", "1e999", "null", "//", "\n", ":[")

scalars = st.one_of(
    st.sampled_from(SIZES), st.integers(-5, 200), st.booleans(), st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from((0.0, -0.5, 0.5, 1e-300, 1e300, 1.5, 10000.0)),
    st.sampled_from(("", "4", "1e4", "silu", "gelu", "llama", "qwen3", "sliding_attention", "full_attention",
                     "LlamaForCausalLMEagle3", "eagle3", "yarn", "../model.safetensors", "/dev/null",
                     "model.safetensors", "config.json", SHARDS[0])),
    st.text(max_size=6))
values = st.one_of(
    scalars, st.sampled_from(BLOCKS),
    st.lists(scalars, max_size=4),
    st.lists(st.sampled_from(("sliding_attention", "full_attention")), max_size=3),
    st.dictionaries(st.sampled_from(KEYS), scalars, max_size=3))


def json_op(draw, base: Base, file: str, kind: str) -> tuple:
    """One operation on a JSON tree (or, for "jsonl", one line's tree): the path drawn from the base's tree."""
    tree = base.json_paths.get(file, ())
    op = draw(st.sampled_from(("set", "set", "delete", "add", "wrap")))
    if op == "add":
        parents = [()] + [p for p in tree if not isinstance(p[-1], int)] if kind == "json" else \
            [(i,) for i in sorted({p[0] for p in tree})]
        return (kind, file, "add", draw(st.sampled_from(parents)), draw(st.sampled_from(KEYS) | st.text(max_size=5)),
                draw(values))
    path = draw(st.sampled_from(tree))
    if op == "set":
        return (kind, file, "set", path, draw(values))
    return (kind, file, op, path)


@st.composite
def operation(draw, base: Base, inputs: tuple[str, ...]) -> tuple:
    kinds = base.files()
    present = [k for k in ("config", "index", "weights") if kinds[k]] + [k for k in inputs if kinds[k]]
    kind = draw(st.sampled_from(present))
    file = draw(st.sampled_from(kinds[kind]))
    if kind in ("config", "index", "target"):
        form = draw(st.sampled_from(("tree", "tree", "tree", "tree", "text", "file")))
        if form == "tree":
            return json_op(draw, base, file, "json")
        if form == "text":
            return text_op(draw, file)
        return ("file", file, draw(st.sampled_from(("delete", "empty"))))
    if kind == "data":
        form = draw(st.sampled_from(("tree", "tree", "tree", "line", "text")))
        if form == "tree":
            return json_op(draw, base, file, "jsonl")
        if form == "text":
            return text_op(draw, file)
        line = draw(st.integers(0, 3))
        op = draw(st.sampled_from(("drop", "copy", "raw")))
        return ("line", file, op, line) + ((draw(st.sampled_from(SNIPPETS) | st.text(max_size=8)),) if op == "raw"
                                           else ())
    names = base.tensors[file]
    form = draw(st.sampled_from(("tensor", "tensor", "tensor", "header", "header", "bytes", "file")))
    if form == "file":
        return ("file", file, draw(st.sampled_from(("delete", "empty"))))
    if form == "bytes":
        op = draw(st.sampled_from(("truncate", "flip", "header_length")))
        if op == "header_length":
            return ("bytes", file, op, draw(st.sampled_from((0, 1, 7, 2 ** 20, 2 ** 40, 2 ** 64 - 1))
                                           | st.integers(-64, 64)))
        return ("bytes", file, op, draw(st.floats(0, 1)), draw(st.integers(0, 255)))
    name = draw(st.sampled_from(names))
    if form == "header":
        op = draw(st.sampled_from(("set", "rename", "delete", "metadata")))
        if op == "set":
            key = draw(st.sampled_from(("dtype", "shape", "data_offsets")))
            value = draw(st.sampled_from(DTYPES)) if key == "dtype" else \
                draw(st.lists(st.sampled_from(SIZES) | st.integers(0, 200), max_size=3) | values)
            return ("header", file, "set", name, key, value)
        if op == "rename":
            return ("header", file, "rename", name, draw(new_names(names)))
        if op == "metadata":
            return ("header", file, "metadata", draw(values))
        return ("header", file, "delete", name)
    op = draw(st.sampled_from(("nonfinite", "cast", "reshape", "drop", "add", "rename", "fill")))
    if op == "nonfinite":
        return ("tensor", file, op, name, draw(st.sampled_from(("nan", "inf", "-inf"))), draw(st.floats(0, 1)))
    if op == "cast":
        return ("tensor", file, op, name, str(draw(st.sampled_from(CASTS))).removeprefix("torch."))
    if op == "reshape":
        return ("tensor", file, op, name, draw(st.sampled_from(("transpose", "flatten", "unsqueeze", "narrow",
                                                                "widen", "empty"))))
    if op in ("add", "rename"):
        return ("tensor", file, op, name, draw(new_names(names)))
    if op == "fill":
        return ("tensor", file, op, name, draw(st.sampled_from((0, 1, -1, 96, 97, 2 ** 31, -(2 ** 40)))))
    return ("tensor", file, op, name)


def new_names(names: tuple[str, ...]):
    """A tensor name to rename to or add: another of the file's, a variant in another format's naming, or junk."""
    variants = [v for n in names for v in (f"model.{n}", n.replace("layers.0.", "midlayer."),
                                           n.replace("fc_norm.0", "aux_norm_low"), n + ".bias", n.upper())]
    return st.sampled_from(list(names) + variants + ["", "__metadata__", "layers.7.mlp.up_proj.weight",
                                                     "d2t", "t2d", "lm_head.weight", "fc.bias", "verifier_norm.weight",
                                                     "hidden_states", "token_ids"]) | st.text(max_size=6)


def text_op(draw, file: str) -> tuple:
    op = draw(st.sampled_from(("truncate", "insert", "deep")))
    if op == "deep":
        return ("text", file, op, draw(st.sampled_from((50, 2000, 100_000))))
    if op == "truncate":
        return ("text", file, op, draw(st.floats(0, 1)))
    return ("text", file, op, draw(st.floats(0, 1)), draw(st.sampled_from(SNIPPETS) | st.text(max_size=4)))


# The inputs a run is given besides the draft: each combination the verdict's options allow.
INPUTS = ((), (DATA,), (DATA, DUMP), (TARGET,), (DATA, DUMP, TARGET))
KIND_OF = {DATA: "data", DUMP: "dump", TARGET: "target"}


@st.composite
def mutants(draw, bases: list[Base], combinations: tuple = INPUTS) -> "Mutant":
    base = draw(st.sampled_from(bases))
    inputs = draw(st.sampled_from(combinations))
    ops = draw(st.lists(operation(base, tuple(KIND_OF[i] for i in inputs)), min_size=1, max_size=3))
    return Mutant(base.id, inputs, tuple(ops))


@dataclass(frozen=True)
class Mutant:
    base: str
    inputs: tuple[str, ...]       # DATA, DUMP, TARGET: what the run is given besides the draft
    ops: tuple[tuple, ...]

    def write(self, bases: dict[str, Base], out: Path) -> Path:
        """The mutated inputs under `out` (a fresh copy of the base)."""
        shutil.copytree(bases[self.base].root, out)
        for op in self.ops:
            apply(op, out)
        return out

    def options(self, root: Path) -> dict[str, str]:
        """The verdict's options for these inputs (pytest's names)."""
        given = {DATA: "--training-data", DUMP: "--hidden-states", TARGET: "--target-config"}
        return {"--draft-checkpoint": str(root / "draft"), **{given[i]: str(root / i) for i in self.inputs}}


# ---------------------------------------------------------------- applying an operation

def apply(op: tuple, root: Path) -> None:
    """One operation on the inputs under `root`; one whose target no longer exists (a file deleted, a path
    removed by an earlier operation) does nothing."""
    form, file = op[0], root / op[1]
    if not file.is_file():
        return
    if form == "file":
        file.unlink() if op[2] == "delete" else file.write_bytes(b"")
    elif form == "json":
        text = file.read_text(errors="replace")
        try:
            tree = json.loads(text)
        except (ValueError, RecursionError):
            return
        file.write_text(json.dumps(edit_tree(tree, op[2], op[3], op[4:])))
    elif form in ("jsonl", "line"):
        lines = file.read_text(errors="replace").splitlines()
        line = op[3][0] if form == "jsonl" else op[3]
        if not lines:
            return
        line %= len(lines)
        if form == "line":
            if op[2] == "drop":
                del lines[line]
            elif op[2] == "copy":
                lines.insert(line, lines[line])
            else:
                lines[line] = op[4]
        else:
            try:
                row = json.loads(lines[line])
            except (ValueError, RecursionError):
                return
            lines[line] = json.dumps(edit_tree(row, op[2], op[3][1:], op[4:]))
        file.write_text("".join(f"{text}\n" for text in lines))
    elif form == "text":
        data = file.read_text(errors="replace")
        if op[2] == "truncate":
            file.write_text(data[:int(len(data) * op[3])])
        elif op[2] == "insert":
            at = int(len(data) * op[3])
            file.write_text(data[:at] + op[4] + data[at:])
        elif op[2] == "replace":
            file.write_text(data.replace(op[3], op[4]))
        else:   # nested as deep as a reader may recurse
            file.write_text('{"x": ' + "[" * op[3] + "]" * op[3] + "}")
    elif form == "bytes":
        data = bytearray(file.read_bytes())
        if op[2] == "truncate":
            file.write_bytes(bytes(data[:int(len(data) * op[3])]))
        elif op[2] == "flip":
            if data:
                data[min(int(len(data) * op[3]), len(data) - 1)] ^= op[4] or 1
            file.write_bytes(bytes(data))
        else:
            file.write_bytes(struct.pack("<Q", op[3] % 2 ** 64) + bytes(data[8:]))
    elif form == "header":
        edit_header(file, op[2:])
    elif form == "tensor":
        edit_tensors(file, op[2:])


def edit_tree(tree, op: str, path: tuple, args: tuple):
    """`tree` with one edit at `path` (a path that does not resolve leaves it as it is)."""
    if op == "add":
        parent = resolve(tree, path)
        if isinstance(parent, dict):
            parent[args[0]] = args[1]
        return tree
    if not path:
        return tree
    parent = resolve(tree, path[:-1])
    key = path[-1]
    if op == "set" and isinstance(parent, dict):   # a key that is not there is added
        parent[key] = args[0]
    elif not _holds(parent, key):
        return tree
    elif op == "set":
        parent[key] = args[0]
    elif op == "delete":
        del parent[key]
    else:   # wrap: the value one level deeper, as a list or an object
        parent[key] = [parent[key]] if isinstance(key, int) or len(str(key)) % 2 else {"value": parent[key]}
    return tree


def resolve(tree, path: tuple):
    for key in path:
        if not _holds(tree, key):
            return None
        tree = tree[key]
    return tree


def _holds(node, key) -> bool:
    return (isinstance(node, dict) and key in node) or (isinstance(node, list) and isinstance(key, int)
                                                       and -len(node) <= key < len(node))


def edit_header(file: Path, op: tuple) -> None:
    """A safetensors header edited as JSON and written back over the same data (padded to 8 bytes)."""
    data = file.read_bytes()
    if len(data) < 8:
        return
    n = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError):
        return
    if not isinstance(header, dict):
        return
    kind, name = op[0], op[1]
    if kind == "metadata":
        header["__metadata__"] = op[1]
    elif name in header and isinstance(header[name], dict):
        if kind == "set":
            header[name][op[2]] = op[3]
        elif kind == "rename":
            header[op[2]] = header.pop(name)
        else:
            del header[name]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


def edit_tensors(file: Path, op: tuple) -> None:
    """Tensors changed as values and the file saved again by safetensors (a valid file, wrong content)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors, metadata = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    except Exception:   # an earlier operation broke the file: nothing to edit as tensors
        return
    kind, name = op[0], op[1]
    if name not in tensors:
        return
    t = tensors[name]
    if kind == "nonfinite":
        if t.is_floating_point() and t.numel():
            t = t.clone()
            t.view(-1)[min(int(t.numel() * op[3]), t.numel() - 1)] = float(op[2])
    elif kind == "cast":
        t = t.to(getattr(torch, op[2]))
    elif kind == "reshape":
        how = op[2]
        if how == "transpose" and t.dim() == 2:
            t = t.T.contiguous()
        elif how == "flatten":
            t = t.flatten()
        elif how == "unsqueeze":
            t = t.unsqueeze(0)
        elif how == "narrow" and t.numel():
            t = t.narrow(0, 0, max(t.shape[0] - 1, 0)).contiguous()
        elif how == "widen" and t.dim():
            t = torch.cat([t, t[:1]])
        elif how == "empty":
            t = t.new_zeros((0, *t.shape[1:]))
    elif kind == "drop":
        del tensors[name]
        t = None
    elif kind in ("add", "rename"):
        if kind == "rename":
            del tensors[name]
        tensors[op[2]] = t.clone()
        t = None
    elif kind == "fill" and not t.is_floating_point():   # ids and maps: d2t, t2d, token_ids
        try:
            t = torch.full_like(t, op[2])
        except RuntimeError:   # the value overflows the dtype
            pass
    if t is not None:
        tensors[name] = t
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata=metadata)
    except Exception:   # a name safetensors refuses to write ("__metadata__"): the file stays as it was
        pass


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, to prove that nothing the run read was written."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
