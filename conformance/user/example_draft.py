"""A tiny example draft on disk to try --draft-checkpoint with: clean, with a planted problem, or the seed's scenario.

    python -m conformance.user.example_draft DIR [--format specforge|sglang|sglang-legacy|speculators|nemo]
                                                 [--plant PROBLEM] [--broken] [--seed-scenario]
                                                 [--prepared-for sglang]

writes DIR/draft/ (config.json, model.safetensors; a trainer's own format with a save path of its own, its
adapter's `save_checkpoint`, as that trainer saves it: NeMo's checkpointer writes
DIR/draft/epoch_0_step_1/model/consolidated/, the directory to check), DIR/train.jsonl (training samples),
DIR/hidden_states/ (their aux states from a tiny target, speculators' datagen layout) and
DIR/target/config.json (that tiny target's config, for --target-config), and prints the check of all of it,
server flags included (a chain within the draft's positions), as a `make check` line and as the entry
point's, every path absolute and every option in its `=` form. The specforge
format is written as SpecForge exports it: midlayer names, no embed_tokens. --plant trains-in one knob
SGLang serves differently (PLANTS); --broken (= --plant dropped_tensor) adds an fc.bias the config does
not declare (a draft trained with a bias whose config lost it): the reference uses it, SGLang's loader
drops it silently, speculators' refuses it.

--prepared-for SERVER then runs the trainer's own helper that prepares its saved directory for that server (NeMo's
serve_sglang, which renames the class and keeps the target's num_hidden_layers: the directory to check).

--seed-scenario writes the seed's scenario instead: the draft (SGLang's format) trained on the target layers
[embed, 3, 31] whose config.json says eagle_config ids [3, 31, 59], as Kimi-K2.5 serving configs do, with
Kimi-K2.5's real config as DIR/target/config.json; its check states what training captured (TRAINED_AUX) and
has the seed's server flags (16 draft tokens with topk 1).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
from pathlib import Path

import torch

from conformance.checkpoints.directory import write_draft
from conformance.checkpoints import WRITABLE, config_json, from_canonical
from conformance.checkpoints.hidden_states import TinyTarget, write_dump
from conformance.checkpoints.training_data import load_samples, make_samples, write_samples
from fixtures.real_configs import REAL_CONFIGS
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


def write_example(root: Path, fmt: str = "specforge", broken: bool = False, plant: str | None = None,
                  knobs: dict | None = None, prepared_for: str | None = None) -> tuple[Path, Path, Path]:
    """(draft dir, JSONL file, hidden-state dump dir) under `root`; `knobs`: further config overrides;
    `prepared_for`: a server whose preparation by the trainer's own helper the draft directory then gets
    (prepare_as_trainer)."""
    broken = broken or plant == DROPPED_TENSOR
    cfg = make_config(**{**EXAMPLE, **(PLANTS[plant] if plant else {}), **(knobs or {})}) if plant or knobs \
        else EXAMPLE_CONFIG
    weights = make_draft_weights(cfg, torch.Generator().manual_seed(SEED))
    if broken:
        weights["fc.bias"] = 0.5 * torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(SEED + 5))
    draft = write_as_trained(cfg, weights, root / "draft", fmt)
    if prepared_for is not None:
        draft = prepare_as_trainer(draft, fmt, prepared_for)
    ids = make_samples(cfg, LENGTHS, torch.Generator().manual_seed(SEED + 4))
    data = write_samples(root / "train.jsonl", ids, n_prompt=list(PROMPTS))
    samples = load_samples(data, cfg.vocab_size)
    target = TinyTarget(cfg, torch.Generator().manual_seed(SEED + 2))
    dump = write_dump(root / "hidden_states", samples, [target.hidden_states(list(s.input_ids)) for s in samples])
    return draft, data, dump


def write_as_trained(cfg, weights: dict[str, torch.Tensor], out: Path, fmt: str) -> Path:
    """The draft in `fmt` as its trainer writes it: by that trainer's own save path where its adapter has one
    (NeMo's checkpointer, into a run directory: the draft directory is what it returns), else this suite's writer
    (SpecForge's export drops embed_tokens)."""
    from conformance.adapters import ADAPTERS

    save = next((a.save_checkpoint for a in ADAPTERS.values() if a.checkpoint_format == fmt and a.save_checkpoint),
                None)
    if save is None:
        return write_draft(cfg, weights, out, fmt, drop_embed=fmt == "specforge")
    stored = {from_canonical(name, fmt): tensor for name, tensor in sorted(weights.items())}
    return save(config_json(cfg, fmt), stored, out / RUN_DIR)


def prepare_as_trainer(draft: Path, fmt: str, server: str) -> Path:
    """The directory the trainer of `fmt` hands `server`, prepared by that trainer's own helper (its adapter's
    `prepare_for_server`; NeMo's serve_sglang rewrites the saved config.json in place)."""
    from conformance.adapters import ADAPTERS

    prepare = next((a.prepare_for_server[server] for a in ADAPTERS.values()
                    if a.checkpoint_format == fmt and server in a.prepare_for_server), None)
    if prepare is None:
        raise ValueError(f"no trainer's own helper prepares the {fmt} format for {server}")
    return prepare(draft)


# A trainer's own save path writes into a run directory named as its recipe names one (NeMo's train_eagle3.py:1638).
RUN_DIR = "epoch_0_step_1"


# Server flags the example is served with: a chain of the draft's trained steps, at a context its positions cover.
EXAMPLE_SGLANG_ARGS = ("--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 "
                       "--context-length {context}")


def write_example_target(root: Path, fmt: str = "specforge", plant: str | None = None) -> Path:
    """root/target/config.json: the config of the tiny target write_example's hidden states come from."""
    cfg = make_config(**{**EXAMPLE, **PLANTS[plant]}) if plant else EXAMPLE_CONFIG
    config = TinyTarget(cfg, torch.Generator().manual_seed(SEED + 2)).model.config.to_dict()
    config = {k: v for k, v in config.items() if v is not None and k not in ("_name_or_path", "transformers_version")}
    config.update(architectures=["LlamaForCausalLM"], dtype="float32")
    path = root / "target" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


# The seed's scenario: what training captured, the ids a Kimi-K2.5 serving config.json says, on that target.
SEED_TARGET = REAL_CONFIGS / "target" / "moonshotai--Kimi-K2.5.json"
SEED_TRAINED, SEED_IDS = "embed,3,31", (3, 31, 59)
# The seed's server flags (16 draft tokens with topk 1, which SGLang serves as 2), at the tiny draft's context.
SEED_SGLANG_ARGS = ("--speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 16 "
                    "--context-length {context}")


def write_seed_scenario(root: Path) -> tuple[Path, Path]:
    """(draft dir, target config) of the seed's scenario under `root`."""
    draft, _, _ = write_example(root, "sglang")
    for extra in (root / "train.jsonl", root / "hidden_states"):   # a tiny target's, not Kimi-K2.5's
        shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(SEED_IDS), "use_aux_hidden_state": True}
    (draft / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    target = root / "target" / "config.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SEED_TARGET, target)
    return draft, target


def check_lines(options: dict[str, str]) -> list[str]:
    """The check of these inputs ("DRAFT" and the entry point's options), as `make check` (in a clone of the
    repository, whose Makefile runs it) and as the entry point; both pasteable from any directory."""
    from conformance.user.commands import check_command

    names = {"DRAFT": "DRAFT", "--data": "DATA", "--hidden": "HIDDEN", "--target-config": "TARGET",
             "--sglang-args": "SGLANG_ARGS", "--trained-aux-layers": "TRAINED_AUX"}
    lines = []
    root = Path(__file__).resolve().parents[2]   # a clone's root, or site-packages when installed
    if (root / "Makefile").is_file():
        here = Path.cwd().resolve() == root
        words = ["make", *([] if here else ["-C", shlex.quote(str(root))]), "check"]
        words += [f'{names[k]}="{v}"' if k == "--sglang-args" else f"{names[k]}={shlex.quote(v)}"
                  for k, v in options.items()]
        lines.append(" ".join(words))
    return lines + [check_command(options)]


def _prepared() -> tuple[str, ...]:
    from conformance.adapters import ADAPTERS

    return tuple(sorted({server for a in ADAPTERS.values() for server in a.prepare_for_server}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", default="specforge", choices=WRITABLE)
    parser.add_argument("--plant", choices=sorted(PLANTS), default=None)
    parser.add_argument("--broken", action="store_true")
    parser.add_argument("--prepared-for", default=None, choices=_prepared(),
                        help="then prepared for this server by the trainer's own helper (nemo: its serve_sglang)")
    parser.add_argument("--seed-scenario", action="store_true",
                        help="the seed's draft: trained on [embed, 3, 31], config.json ids [3, 31, 59], Kimi-K2.5")
    args = parser.parse_args(argv)
    context = EXAMPLE_CONFIG.max_position_embeddings
    if args.seed_scenario:
        draft, target = write_seed_scenario(args.out)
        options = {"DRAFT": draft, "--target-config": target, "--trained-aux-layers": SEED_TRAINED,
                   "--sglang-args": SEED_SGLANG_ARGS.format(context=context)}
    else:
        draft, data, dump = write_example(args.out, args.format, args.broken, args.plant,
                                          prepared_for=args.prepared_for)
        target = write_example_target(args.out, args.format, args.plant)
        options = {"DRAFT": draft, "--data": data, "--hidden": dump, "--target-config": target,
                   "--sglang-args": EXAMPLE_SGLANG_ARGS.format(context=context)}
    for line in check_lines({k: os.path.abspath(v) if isinstance(v, Path) else v for k, v in options.items()}):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
