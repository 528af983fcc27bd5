"""Convert a draft directory into a format SGLang serves (never writing into the source).

    python -m conformance.user.convert DRAFT OUT [--format sglang|sglang-legacy|speculators|specforge]

Reads any format this suite reads (speculators, SGLang, legacy SGLang, SpecForge, the original EAGLE-3
export) and writes OUT/config.json and OUT/model.safetensors with every tensor unchanged and the aux
ids in the target format's convention (conformance/checkpoints/formats.py). A problem is one line on
stderr naming the file and the field, exit code 4.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.checkpoints.directory import convert
from conformance.checkpoints.errors import CheckpointError, ConversionError
from conformance.checkpoints.formats import WRITABLE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", default="sglang", choices=WRITABLE)
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"{args.out}: directory: exists and is not empty (refusing to overwrite)", file=sys.stderr)
        return 4
    try:
        convert(args.draft, args.out, args.format)
    except (CheckpointError, ConversionError) as exc:
        print(str(exc), file=sys.stderr)
        return 4
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
