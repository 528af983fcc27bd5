"""A tiny example draft on disk, to try --draft-checkpoint with, clean or with a planted problem.

    python -m conformance.user.example_draft DIR [--format specforge|sglang|sglang-legacy|speculators]
                                                 [--plant PROBLEM] [--broken]

writes DIR/draft/ (config.json, model.safetensors), DIR/train.jsonl (training samples),
DIR/hidden_states/ (their aux states from a tiny target, speculators' datagen layout) and
DIR/target/config.json (that tiny target's config, for --target-config), and prints the options that check
all of it, server flags included (a chain within the draft's positions). The specforge
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


# Server flags the example is served with: a chain of the draft's trained steps, at a context its positions cover.
EXAMPLE_SGLANG_ARGS = ("--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 "
                       "--context-length {context}")


def write_example_target(root: Path, fmt: str = "specforge", plant: str | None = None) -> Path:
    """root/target/config.json: the config of the tiny target write_example's hidden states come from."""
    import json

    cfg = make_config(**{**EXAMPLE, **PLANTS[plant]}) if plant else EXAMPLE_CONFIG
    config = TinyTarget(cfg, torch.Generator().manual_seed(SEED + 2)).model.config.to_dict()
    config = {k: v for k, v in config.items() if v is not None and k not in ("_name_or_path", "transformers_version")}
    config.update(architectures=["LlamaForCausalLM"], dtype="float32")
    path = root / "target" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", default="specforge", choices=WRITABLE)
    parser.add_argument("--plant", choices=sorted(PLANTS), default=None)
    parser.add_argument("--broken", action="store_true")
    args = parser.parse_args(argv)
    draft, data, dump = write_example(args.out, args.format, args.broken, args.plant)
    target = write_example_target(args.out, args.format, args.plant)
    context = EXAMPLE_CONFIG.max_position_embeddings
    print(f"--draft-checkpoint {draft} --training-data {data} --hidden-states {dump} --target-config {target} "
          f"--sglang-args \"{EXAMPLE_SGLANG_ARGS.format(context=context)}\"")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
