"""Convert a draft directory into a format SGLang serves (never writing into the source).

    python -m conformance.user.convert DRAFT OUT [--format sglang|sglang-legacy|sglang-mla|speculators|specforge|nemo]
                                       [--target-config T] [--trained-aux-layers embed,3,31]

Reads any format this suite reads (speculators, SGLang, legacy SGLang, SpecForge, NeMo Automodel, the original
EAGLE-3 export) and writes OUT/config.json and OUT/model.safetensors with every tensor unchanged and the aux
ids in the target format's convention (conformance/checkpoints/formats.py). Without --format: the format SGLang
serves the draft from (its adapter's format_for: an MLA draft's is sglang-mla, Eagle3DeepseekV2ForCausalLM's,
which SGLang's Llama-draft format cannot express). For SGLang's formats the
eagle_config ids are the ones with which SGLang captures the layers training used: in its Llama
classes' convention (id - 1) by default, or, with --target-config, the ids the target's own class needs,
found on a tiny twin of it (DeepSeek and Kimi read them as written unless the first is 1:
conformance/user/servable.py served_ids). --trained-aux-layers states those layers when the draft's
config.json does not. A problem is one line on stderr naming the file and the field, exit code 4.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from conformance.adapters import ADAPTERS, DEFAULT_SERVER
from conformance.checkpoints.directory import convert, open_checkpoint
from conformance.checkpoints.errors import CheckpointError, ConversionError
from conformance.checkpoints.formats import WRITABLE
from conformance.checkpoints.knobs import CONFIG_FILE
from conformance.checkpoints.targets import read_target_config
from conformance.user.servable import served_ids, write_served_ids
from conformance.user.trainer import TRAINED_OPTION, OptionError, parse_trained_layers, resolve_trainer

SGLANG_FORMATS = ("sglang", "sglang-legacy", "sglang-mla")   # the formats whose config.json SGLang reads the ids from


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", default=None, choices=WRITABLE,
                        help="default: the format SGLang serves the draft from (sglang; sglang-mla for an MLA draft)")
    parser.add_argument("--target-config", type=Path, default=None,
                        help="the target's config.json: write the eagle_config ids its SGLang class needs")
    parser.add_argument(TRAINED_OPTION, dest="trained", default=None,
                        help="the target layers training captured, e.g. embed,3,31 (input of layer i)")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"{args.out}: directory: exists and is not empty (refusing to overwrite)", file=sys.stderr)
        return 4
    try:
        ckpt = open_checkpoint(args.draft)
        layers = read_target_config(args.target_config)["num_hidden_layers"] if args.target_config else None
        stated = None if args.trained is None else parse_trained_layers(
            args.trained, ckpt.config.num_aux_hidden_states, str(args.draft / CONFIG_FILE), layers,
            str(args.target_config))
        fmt = args.format or ADAPTERS[DEFAULT_SERVER]().format_for(ckpt.config)
        convert(args.draft, args.out, fmt)
        if fmt in SGLANG_FORMATS and (args.target_config or stated):
            with tempfile.TemporaryDirectory() as twins:
                ids, why = served_ids(resolve_trainer(ckpt, "auto", stated), args.target_config, Path(twins))
            write_served_ids(args.out, ids)
            print(f"eagle_config ids {list(ids) if ids else 'none'}: {why}", file=sys.stderr)
    except (CheckpointError, ConversionError, OptionError) as exc:
        print(str(exc), file=sys.stderr)
        return 4
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
