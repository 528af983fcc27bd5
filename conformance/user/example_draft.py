"""A tiny example draft on disk, to try --draft-checkpoint with, clean or with a planted problem.

    python -m conformance.user.example_draft DIR [--format specforge|sglang|sglang-legacy|speculators]
                                                 [--plant PROBLEM] [--broken]

writes DIR/draft/ (config.json, model.safetensors), DIR/train.jsonl (training samples) and
DIR/hidden_states/ (their aux states from a tiny target, speculators' datagen layout). The specforge
format is written as SpecForge exports it: midlayer names, no embed_tokens. --plant trains-in one knob
SGLang serves differently (PLANTS); --broken (= --plant dropped_tensor) adds an fc.bias the config does
not declare (a draft trained with a bias whose config lost it): the reference uses it, SGLang's loader
drops it silently, speculators' refuses it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from conformance.checkpoints.directory import write_draft
from conformance.checkpoints import WRITABLE
from conformance.checkpoints.hidden_states import TinyTarget, write_dump
from conformance.checkpoints.training_data import load_samples, make_samples, write_samples
from fixtures.tiny import make_config, make_draft_weights

SEED = 0
EXAMPLE = dict(hidden_size=40, target_hidden_size=40, fc_norm=True)
EXAMPLE_CONFIG = make_config(**EXAMPLE)
LENGTHS, PROMPTS = (10, 6, 13), (4, 2, 5)
DROPPED_TENSOR = "dropped_tensor"
# Knobs a draft can be trained with that SGLang 0.5.23 serves differently (conformance/core/registry.toml).
PLANTS = {
    "norm_before_residual": {"norm_before_residual": True},    # speculators' training default
    "two_layers": {"num_hidden_layers": 2},
    "attention_bias": {"attention_bias": True},
    "sliding_window": {"sliding_window": 4},                    # shorter than the samples
    "fc_skip": {"num_aux_hidden_states": 1, "fc_norm": False},  # A * Ht == H: 1 * 40 == 40
    DROPPED_TENSOR: {},                                         # an fc.bias the config does not declare
}


def write_example(root: Path, fmt: str = "specforge", broken: bool = False,
                  plant: str | None = None, knobs: dict | None = None) -> tuple[Path, Path, Path]:
    """(draft dir, JSONL file, hidden-state dump dir) under `root`; `knobs`: further config overrides."""
    broken = broken or plant == DROPPED_TENSOR
    cfg = make_config(**{**EXAMPLE, **(PLANTS[plant] if plant else {}), **(knobs or {})}) if plant or knobs \
        else EXAMPLE_CONFIG
    weights = make_draft_weights(cfg, torch.Generator().manual_seed(SEED))
    if broken:
        weights["fc.bias"] = 0.5 * torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(SEED + 5))
    draft = write_draft(cfg, weights, root / "draft", fmt, drop_embed=fmt == "specforge")
    ids = make_samples(cfg, LENGTHS, torch.Generator().manual_seed(SEED + 4))
    data = write_samples(root / "train.jsonl", ids, n_prompt=list(PROMPTS))
    samples = load_samples(data, cfg.vocab_size)
    target = TinyTarget(cfg, torch.Generator().manual_seed(SEED + 2))
    dump = write_dump(root / "hidden_states", samples, [target.hidden_states(list(s.input_ids)) for s in samples])
    return draft, data, dump


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", default="specforge", choices=WRITABLE)
    parser.add_argument("--plant", choices=sorted(PLANTS), default=None)
    parser.add_argument("--broken", action="store_true")
    args = parser.parse_args(argv)
    draft, data, dump = write_example(args.out, args.format, args.broken, args.plant)
    print(f"--draft-checkpoint {draft} --training-data {data} --hidden-states {dump}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
