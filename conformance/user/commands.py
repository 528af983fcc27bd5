"""The commands a user run prints, each pasteable from any directory: the run itself (`repro:`), and the fixes
this suite applies by a command (its converter, changed server flags) followed by the check of the fixed draft.

Every path is absolute (taken from where pytest ran), every option in its `=` form, the check is the entry
point's (`eagle3-conformance check`, conformance/cli.py: the same checks and exit codes as `make check`).
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from conformance.core.findings import CONVERT, SETTINGS, Problem
from conformance.user.trainer import CHOICES

PROG = "eagle3-conformance"
# check's options -> the pytest options `make check` passes (conformance/plugin.py defines them).
OPTIONS = (
    ("--data", "--training-data", "FILE", "JSONL training samples"),
    ("--hidden", "--hidden-states", "DIR", "the samples' aux hidden states (speculators' datagen layout)"),
    ("--target-config", "--target-config", "FILE", "the target model's config.json"),
    ("--sglang-args", "--sglang-args", "ARGS", "the server's command line, quoted as one argument"),
    ("--trainer", "--trainer", "NAME", f"how the draft was trained: {', '.join(CHOICES)} (auto: detected)"),
    ("--trained-aux-layers", "--trained-aux-layers", "LAYERS", "the layers training captured, e.g. embed,3,31"),
    ("--serve-with", "--serve-with", "SERVER", "the server(s) to check against: sglang (default), vllm or both"),
)
DEFAULT_REPORT = "report"   # make check's REPORT default
CONVERTED = "-sglang"   # the converter's output: the draft's directory name with this suffix, beside it
PATHS = ("--data", "--hidden", "--target-config", "--report")   # the check's options that name a file or directory
# A settings fix that is nothing but server flags (`--speculative-num-steps 15 --speculative-num-draft-tokens 16
# (a chain of 15 draft tokens)`): the check of the fixed draft runs with them.
FLAGS_FIX = re.compile(r"(?P<flags>--[a-z0-9-]+ [^\s(]+(?: --[a-z0-9-]+ [^\s(]+)*)(?: \(.*\))?")


def entry_point() -> list[str]:
    """`eagle3-conformance` of this environment: its script beside this interpreter, or the module."""
    script = Path(sys.executable).parent / PROG
    return [str(script)] if script.is_file() else [sys.executable, "-m", "conformance.cli"]


def user_options(config) -> dict[str, str]:
    """The run's options as `eagle3-conformance check` takes them ("DRAFT" for the draft), paths absolute."""
    from conformance.user.serving import DEFAULT_SERVER   # not at import: conformance/cli.py reads this module first

    here = config.invocation_params.dir

    def absolute(value: str) -> str:
        return os.path.abspath(os.path.join(here, value))

    out = {"DRAFT": absolute(config.getoption("--draft-checkpoint"))}
    for flag, option, _, _ in OPTIONS:
        value = config.getoption(option)
        if value and not (flag == "--trainer" and value == "auto") and \
                not (flag == "--serve-with" and value == DEFAULT_SERVER):
            out[flag] = absolute(value) if flag in PATHS else value
    out["--report"] = absolute(config.getoption("--report") or DEFAULT_REPORT)
    return out


def check_command(options: dict[str, str], extra: tuple[str, ...] = ()) -> str:
    """The entry point's check with these options; `extra`: pytest arguments (after `--`)."""
    words = [*map(shlex.quote, entry_point()), "check", shlex.quote(options["DRAFT"])]
    words += [f"{flag}={shlex.quote(value)}" for flag, value in options.items() if flag != "DRAFT"]
    return " ".join(words + (["--", *map(shlex.quote, extra)] if extra else []))


def repro(config, nodeid: str) -> str:
    """The user's run narrowed to one check: it fails again exactly as it did."""
    return check_command(user_options(config), ("-k", nodeid.rsplit("::", 1)[-1]))


def convert_command(options: dict[str, str], out: str) -> str:
    """The converter on the user's draft into `out`, with the run's target and training layers."""
    words = [sys.executable, "-m", "conformance.user.convert", options["DRAFT"], out]
    words = [*map(shlex.quote, words)]
    words += [f"{flag}={shlex.quote(options[flag])}" for flag in ("--target-config", "--trained-aux-layers")
              if flag in options]
    return " ".join(words)


def with_flags(command_line: str, flags: dict[str, str]) -> str:
    """`command_line` with each flag's value replaced where it stands (or the flag added at the end)."""
    words, out, i = shlex.split(command_line), [], 0
    while i < len(words):
        flag, inline = words[i].split("=", 1)[0], "=" in words[i]
        if flag in flags:
            out += [flag, flags.pop(flag)]
            i += 1 if inline else 2
            continue
        out.append(words[i])
        i += 1
    return shlex.join([*out, *(w for flag, value in flags.items() for w in (flag, value))])


def fix_commands(options: dict[str, str], problems: list[Problem]) -> tuple[list[int], list[str]]:
    """(the numbers of the problems, in verdict order, that a command fixes; the commands: the fixes, then the
    check of the fixed draft); nothing when no command fixes any."""
    fixed, commands, flags = [], [], {}
    recheck = dict(options)
    for number, p in enumerate(problems, 1):
        if p.remedy == CONVERT:
            fixed.append(number)
            out = options["DRAFT"].rstrip("/") + CONVERTED
            if recheck["DRAFT"] != out:
                commands.append(convert_command(options, out))
                recheck["DRAFT"] = out
        elif p.rank == SETTINGS and "--sglang-args" in options and (m := FLAGS_FIX.fullmatch(p.fix)):
            fixed.append(number)
            words = m["flags"].split()
            flags.update(zip(words[::2], words[1::2]))
    if not fixed:
        return [], []
    if flags:
        recheck["--sglang-args"] = with_flags(options["--sglang-args"], dict(flags))
    return fixed, [*commands, check_command(recheck)]
