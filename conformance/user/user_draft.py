"""Bring your own draft: the user's checkpoint, training data, hidden states and target config,
validated up front; the user's case; the pytest options' wiring (called from conformance/plugin.py).

Validation raises one-line CheckpointErrors naming the file and the field (conftest turns them into
pytest.UsageError: exit code 4), for files no implementation can use: unreadable, non-finite, schema
errors. Two implementations reading a usable file differently is a finding of the checks, not bad
input. The user's files are only ever read (conformance/user/store.py runs the checks on copies).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch

from conformance.checkpoints.directory import DraftCheckpoint, open_checkpoint
from conformance.checkpoints.errors import CheckpointError
from conformance.checkpoints.formats import from_canonical
from conformance.checkpoints.hidden_states import read_dump
from conformance.checkpoints.knobs import CONFIG_FILE
from conformance.checkpoints.schema import expected_tensors, needed_by, undeclared_tensors
from conformance.checkpoints.targets import read_target_config
from conformance.checkpoints.training_data import Sample, first_samples, load_samples
from conformance.checkpoints.weights import INDEX_FILE, read_tensor
from conformance.core.common import first_line
from conformance.core.tolerances import dtype_name
from conformance.user.example_draft import EXAMPLE_CONFIG
from conformance.user.trainer import TRAINED_OPTION, OptionError, Trainer, parse_trained_layers, resolve_trainer
from fixtures.cases import DraftCase
from reference.eagle3 import Eagle3Config

USER_CASE_ID = "user_draft"
SEED = 0                                    # the user case's seed: substituted weights, random inputs
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class UserInputs:
    checkpoint: DraftCheckpoint
    config: Eagle3Config
    source: str                                       # what ran, for the report (no temp paths)
    samples: list[Sample] | None = None
    data_file: Path | None = None
    hidden_states: Path | None = None
    target: dict | None = None
    target_file: Path | None = None                   # --target-config, for the checks that read it themselves
    sglang_args: str | None = None                    # --sglang-args, parsed by SGLang's own parser
    trainer: Trainer | None = None
    notes: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)   # every input file -> sha256, to prove it untouched


# ---------------------------------------------------------------- validation

def validate_checkpoint(path: Path) -> tuple[DraftCheckpoint, list[str]]:
    """Config, tensor names, shapes, dtypes, finiteness and the vocab map; the first problem raises."""
    from conformance.loading.accounting import vocab_map_problems

    ckpt = open_checkpoint(Path(path))
    cfg = ckpt.config                     # unsupported or contradictory knobs raise here
    notes = list(ckpt.parsed.notes)
    weights_file = next(iter(ckpt.tensors.values())).file if ckpt.tensors else Path(path)
    # The schema lists every layer's tensors: a layer count far above the stored layers (2**31) is refused
    # at its first missing layer, before the schema is built.
    stored = {n.split(".")[1] for n in ckpt.tensors if n.startswith("layers.")}
    missing = next(i for i in range(cfg.num_hidden_layers + 1) if str(i) not in stored)
    if missing < cfg.num_hidden_layers - 1:
        name = from_canonical(f"layers.{missing}.input_layernorm.weight", ckpt.format)
        raise CheckpointError(weights_file, f"tensor {name}",
                              f"missing (needed because num_hidden_layers is {cfg.num_hidden_layers})")
    expected, optional = expected_tensors(cfg), undeclared_tensors(cfg)
    for name in expected:
        if name in ckpt.tensors:
            continue
        if name == "embed_tokens.weight":
            notes.append("embed_tokens absent (as SpecForge and EAGLE-3 export): SGLang serves with the target's; "
                         "this run substitutes a seeded random one for every implementation")
            continue
        raise CheckpointError(weights_file, f"tensor {from_canonical(name, ckpt.format)}",
                              f"missing (needed because {needed_by(name, cfg)})")
    for name, info in ckpt.tensors.items():
        where = (info.file, f"tensor {info.stored_name}")
        if name not in expected and name not in optional:
            raise CheckpointError(*where, "extra tensor: not part of an EAGLE-3 draft with this config.json")
        shape, kind = expected.get(name) or optional[name]
        if info.shape != shape:
            raise CheckpointError(*where, f"shape {info.shape}, expected {shape} from {CONFIG_FILE}")
        if kind == "float" and info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(*where, f"dtype {dtype_name(info.dtype)}, expected a float dtype (fp32, bf16, fp16)")
        if kind == "int64" and info.dtype != torch.int64:
            raise CheckpointError(*where, f"dtype {dtype_name(info.dtype)}, expected int64 "
                                          "(offsets, speculators model.py:51-55)")
        if kind == "bool" and info.dtype != torch.bool:
            raise CheckpointError(*where, f"dtype {dtype_name(info.dtype)}, expected bool (speculators model.py:51-55)")
        if name not in expected:
            notes.append(f"{info.stored_name}: not declared by {CONFIG_FILE}; implementations treat it differently "
                         "(see weight accounting)")
    vocab = {}
    for name, info in ckpt.tensors.items():
        tensor = read_tensor(info)
        if tensor.is_floating_point():
            bad = (~torch.isfinite(tensor)).nonzero()
            if bad.numel():
                index = tuple(int(i) for i in bad[0])
                raise CheckpointError(info.file, f"tensor {info.stored_name}",
                                      f"{tensor[index].item()} at index {index} (NaN/inf weights)")
        if name in ("d2t", "t2d"):
            vocab[name] = tensor
    for name, problem in vocab_map_problems(vocab, cfg.vocab_size, cfg.draft_vocab_size):
        info = ckpt.tensors.get(name)
        raise CheckpointError(info.file if info else weights_file,
                              f"tensor {info.stored_name if info else name}", problem)
    return ckpt, notes


def digest(path: Path) -> str:
    """sha256 of a file, read in chunks (a real-size draft is gigabytes)."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def input_files(*paths: Path | None) -> list[Path]:
    out = []
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        out += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else ([p] if p.is_file() else [])
    return out


# What an exception of the validation itself (not a CheckpointError: a bug of this suite) says, after the file.
UNEXPECTED = "could not be validated (an error in this suite's validation, please report it"


@contextmanager
def validating(path: Path | str | None):
    """An exception that validating `path` raises besides a CheckpointError or an OptionError is a bug of
    this suite; it is still one line naming the file, never a traceback (raised from pytest_configure,
    pytest prints INTERNALERROR and exits 3)."""
    try:
        yield
    except (CheckpointError, OptionError):
        raise
    except Exception as exc:
        raise CheckpointError(path, "file", f"{UNEXPECTED}: {type(exc).__name__}: {first_line(exc)})") from exc


def validate_inputs(checkpoint: Path, data: Path | None = None, hidden_states: Path | None = None,
                    target: Path | None = None, source: str | None = None, trainer: str = "auto",
                    trained_layers: str | None = None, sglang_args: str | None = None) -> UserInputs:
    """Every user input, validated; the first problem raises a one-line CheckpointError (OptionError for
    an option's value), whatever goes wrong (`validating`)."""
    with validating(checkpoint):
        ckpt, notes = validate_checkpoint(Path(checkpoint))
        cfg = ckpt.config
    with validating(target):
        target_cfg = read_target_config(Path(target)) if target is not None else None
        if target_cfg is not None and not target_cfg["architectures"]:
            raise CheckpointError(target, "field architectures",
                                  "missing or empty: SGLang picks the target's class by it")
    with validating(ckpt.path / CONFIG_FILE):
        stated = None if trained_layers is None else parse_trained_layers(
            trained_layers, cfg.num_aux_hidden_states, str(ckpt.path / CONFIG_FILE),
            target_cfg["num_hidden_layers"] if target_cfg else None, str(target))
        if sglang_args is not None:
            check_command_line(sglang_args)
        inputs = UserInputs(ckpt, cfg, source or f"--draft-checkpoint {Path(checkpoint).name} ({ckpt.format} format)",
                            trainer=resolve_trainer(ckpt, trainer, stated), notes=notes, sglang_args=sglang_args)
    if data is not None:
        with validating(data):
            inputs.data_file = Path(data)
            inputs.samples = load_samples(Path(data), cfg.vocab_size)
    if hidden_states is not None:
        if inputs.samples is None:
            raise CheckpointError(hidden_states, "option --hidden-states",
                                  "needs --training-data (the dump's token ids)")
        with validating(hidden_states):
            inputs.hidden_states = Path(hidden_states)
            read_dump(Path(hidden_states), inputs.samples[:len(first_samples(inputs.samples))], cfg)
    if target is not None:
        inputs.target, inputs.target_file = target_cfg, Path(target)
    # The files this run reads (not whatever else lives in the user's directories).
    read = [ckpt.path / CONFIG_FILE, *dict.fromkeys(i.file for i in ckpt.tensors.values())]
    read += [ckpt.path / INDEX_FILE] if (ckpt.path / INDEX_FILE).is_file() else []
    if inputs.hidden_states is not None:
        read += [inputs.hidden_states / f"hs_{i}.safetensors" for i in range(len(first_samples(inputs.samples)))]
    for p in read + input_files(data, target):
        with validating(p):
            inputs.digests[str(p)] = digest(p)
    return inputs


def check_command_line(line: str) -> None:
    """--sglang-args through SGLang's own parser (no files needed): what it cannot parse is bad input.
    What SGLang's resolution then refuses for this draft and target is a finding of the settings check."""
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    from conformance.adapters import ADAPTERS, DEFAULT_SERVER

    class Parser(argparse.ArgumentParser):
        def error(self, message):   # argparse would print its usage and exit 2
            raise OptionError(f"--sglang-args {line!r}: {message}")

    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise OptionError(f"--sglang-args {line!r}: {exc}") from None
    parser = Parser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    parser.parse_args(["--model-path", "target", *ADAPTERS[DEFAULT_SERVER].server_settings.HOST_ARGS, *argv])


# ---------------------------------------------------------------- the user's case

def user_case(cfg: Eagle3Config, lengths: tuple[int, ...], summary: str) -> DraftCase:
    """The user's draft as a DraftCase: every knob spelled out, so known divergences match as for any case."""
    overrides = tuple((f.name, getattr(cfg, f.name)) for f in fields(Eagle3Config))
    return DraftCase(USER_CASE_ID, overrides, lengths, seed=SEED, summary=summary)


# ---------------------------------------------------------------- pytest wiring (called from conformance/plugin.py)

INPUTS_KEY = pytest.StashKey[UserInputs]()
TARGET_KEY = pytest.StashKey[dict]()


def configure_user_inputs(config) -> None:
    """Validate --draft-checkpoint, --training-data, --hidden-states, --target-config; stash the result."""
    ckpt, data = config.getoption("--draft-checkpoint"), config.getoption("--training-data")
    hidden, target = config.getoption("--hidden-states"), config.getoption("--target-config")
    trained = config.getoption(TRAINED_OPTION)
    if (data or hidden or trained) and not ckpt:
        option = "--training-data" if data else "--hidden-states" if hidden else TRAINED_OPTION
        raise pytest.UsageError(f"{option} needs --draft-checkpoint (it describes that draft's inputs)")
    try:
        if target:
            with validating(target):
                config.stash[TARGET_KEY] = read_target_config(Path(target))
        if ckpt:
            inputs = validate_inputs(Path(ckpt), Path(data) if data else None, Path(hidden) if hidden else None,
                                     Path(target) if target else None, trainer=config.getoption("--trainer") or "auto",
                                     trained_layers=trained, sglang_args=config.getoption("--sglang-args"))
            config.stash[INPUTS_KEY] = inputs
    except (CheckpointError, OptionError) as exc:
        raise pytest.UsageError(str(exc)) from None


def collection_case(config) -> DraftCase:
    """The user case as known at collection (its knobs decide the known-divergence marks)."""
    inputs = config.stash.get(INPUTS_KEY, None)
    cfg = inputs.config if inputs is not None else EXAMPLE_CONFIG
    return user_case(cfg, (), "")


# The draft the user checks run on without --draft-checkpoint: SpecForge's export, so its trainer is SpecForge.
FIXTURE_FORMAT = "specforge"
