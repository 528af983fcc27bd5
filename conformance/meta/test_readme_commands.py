"""The README's "your draft" commands, run as a user runs them, and the links of README.md and docs/*.md.

The quick start's `make check` line is a template; the seed's block under it ("The seed's bug") is that line
filled in for the seed's scenario, which the generator line before it writes. Those commands run here in
subprocesses, from the repository root, on the files the generator writes (into a temporary directory instead
of out/): each must exit with the code its comment claims, and what it prints from the verdict on must be the
block pasted under it, line for line (a `...` line stands for lines left out), except the `versions:` line,
which names the environment that ran; the absolute paths it prints are shown from `$PWD`. Then the commands the
verdict prints to fix the draft and check it again run as printed, from another directory: they end in "served
as trained". Every relative link of README.md and docs/*.md must name a file that exists (and a heading of it,
for an anchor); a planted broken link shows the checker can fail.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
QUICK_START, REAL_VERDICT = "## Quick start", "### The seed's bug"
GENERATOR = "conformance.user.example_draft"
CLAIM = re.compile(r"\bexit (\d+)\b")          # what a command's comment says it exits with
PLACEHOLDER = re.compile(r"path/to/|\.\.\.")   # a quick-start value the user replaces
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment) of one shell line: the comment starts at the first word-initial # outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def blocks_under(heading: str) -> list[str]:
    """The fenced blocks between the heading that starts with `heading` and the next heading, without fences."""
    lines = README.read_text().split(f"\n{heading}", 1)[1].splitlines()[1:]   # after the heading's line
    blocks, block = [], None
    for line in lines:
        if line.startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append("\n".join(block) + "\n")
                block = None
        elif block is not None:
            block.append(line)
        elif line.startswith("#"):   # the next heading (a `#` inside a block is a comment)
            break
    return blocks


def commands(heading: str) -> list[tuple[list[str], int | None]]:
    """The first `sh` block under `heading`: each command's words (`\\` lines joined) and the exit code its
    comment claims (None: no claim)."""
    block = next(b for b in blocks_under(heading) if not b.startswith("VERDICT"))
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        command, comment = split_comment(line)
        if command:
            claim = CLAIM.search(comment)
            out.append((shlex.split(command), int(claim.group(1)) if claim else None))
    return out


def make_variables(words: list[str]) -> dict[str, str]:
    assert words[:2] == ["make", "check"], words
    return dict(word.split("=", 1) for word in words[2:])


def real_verdict() -> tuple[list[str], int, list[str], int]:
    """(generator words, its claimed exit, make check words, its claimed exit) of the "A real verdict" block."""
    (generator, generated), (check, checked) = commands(REAL_VERDICT)
    assert GENERATOR in generator and generated is not None and checked is not None, (generator, check)
    return generator, generated, check, checked


def written(generator: list[str]) -> str:
    """The directory the generator writes (its one positional argument)."""
    return next(word for word in generator[3:] if not word.startswith("-"))


def test_the_quick_start_is_the_real_verdicts_command_filled_in():
    quick = commands(QUICK_START)
    quick_check = make_variables(next(words for words, _ in quick if words[:2] == ["make", "check"]))
    generator, _, check, _ = real_verdict()
    assert all(PLACEHOLDER.search(value) for value in quick_check.values()), quick_check
    filled = make_variables(check)
    assert set(quick_check) <= set(filled), f"the real verdict leaves out {set(quick_check) - set(filled)}"
    assert filled["DRAFT"] == f"{written(generator)}/draft", "the real verdict checks another draft than it writes"
    assert not any(PLACEHOLDER.search(value) for value in filled.values()), filled


def pasted_verdict() -> list[str]:
    """The verdict block pasted under the real verdict's commands."""
    block = next(b for b in blocks_under(REAL_VERDICT) if "VERDICT: " in b)
    return block.splitlines()


def printed_verdict(stdout: str) -> list[str]:
    """What a run prints from its verdict on: the verdict ends the run."""
    return stdout[stdout.index("VERDICT: "):].splitlines()


def matches(pasted: list[str], printed: list[str]) -> bool:
    """The pasted lines are the printed ones, where a `...` line stands for any number of lines left out."""
    segments, current = [], []
    for line in pasted:
        if line.strip() == "...":
            segments.append(current)
            current = []
        else:
            current.append(line)
    segments.append(current)
    at = 0
    for i, segment in enumerate(segments):
        if i == 0:
            if printed[:len(segment)] != segment:
                return False
            at = len(segment)
            continue
        found = next((j for j in range(at, len(printed) - len(segment) + 1)
                      if printed[j:j + len(segment)] == segment), None)
        if found is None:
            return False
        at = found + len(segment)
    return at == len(printed) or pasted[-1].strip() == "..."


def without_versions(lines: list[str]) -> list[str]:
    found = [line for line in lines if line.startswith("  versions: ")]
    assert len(found) == 1, lines
    return [line for line in lines if not line.startswith("  versions: ")]


def fix_commands(lines: list[str]) -> list[str]:
    """The commands under the verdict's "fix ... and check again" line."""
    at = next(i for i, line in enumerate(lines) if line.startswith("fix ") and "and check again" in line)
    return [line.strip() for line in lines[at + 1:] if line.startswith("  ")]


def test_a_cut_block_matches_only_its_lines():
    printed = ["VERDICT: x", "a", "b", "c", "d"]
    assert matches(["VERDICT: x", "...", "c", "d"], printed) and matches(["VERDICT: x", "a", "..."], printed)
    assert not matches(["VERDICT: x", "...", "b", "d"], printed) and not matches(["VERDICT: x", "a"], printed)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readme_verdict_commands_exit_as_the_readme_says(tmp_path):
    generator, generated, check, checked = real_verdict()
    out = written(generator)
    here, report = str(tmp_path / out), str(tmp_path / "report")

    def local(word: str) -> str:   # the README's out/... path, in the temporary directory
        return re.sub(rf"(^|=){re.escape(out)}(?=/|$)", lambda m: m.group(1) + here, word)

    def as_shown(text: str) -> str:   # the absolute paths a run prints, as the README shows them
        for real, shown in ((report, "$PWD/report"), (here, f"$PWD/{out}"), (f"{sys.prefix}/bin", "$PWD/.venv/bin"),
                            (str(ROOT), "$PWD")):
            text = text.replace(real, shown)
        return text

    # make as a user runs it, at the top level: under `make test` the inherited MAKELEVEL/MAKEFLAGS would make it
    # name its level (make[1]) and print "Entering/Leaving directory" lines into the verdict's output.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env["OMP_NUM_THREADS"] = "1"
    # .venv/bin/python is this environment in a clone; so is make's VENV, which make must not rebuild (-o):
    # the environment the suite runs in is the one under test, and a shared one is never reinstalled from here.
    assert generator[0] == ".venv/bin/python", generator
    wrote = subprocess.run([sys.executable, *map(local, generator[1:])], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert wrote.returncode == generated, wrote.stdout + wrote.stderr
    assert (Path(here) / "draft" / "config.json").is_file(), wrote.stdout

    venv = sys.prefix
    assert check[0] == "make", check
    argv = ["make", "-o", f"{venv}/.installed", *map(local, check[1:]), f"VENV={venv}", f"REPORT={report}"]
    ran = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (ran.stdout + ran.stderr)[-3000:]
    # make exits 2 whenever pytest does not exit 0, and names pytest's code on its last line (the README says so)
    if checked == 0:
        assert ran.returncode == 0, tail
    else:
        assert ran.returncode == 2, tail
        assert re.search(rf"make: \*\*\* \[\S+: check\] Error {checked}$", ran.stderr.strip()), tail
    printed = without_versions(printed_verdict(as_shown(ran.stdout)))
    assert matches(without_versions(pasted_verdict()), printed), "\n".join(printed)
    assert len(ran.stdout.splitlines()) < 100, f"{len(ran.stdout.splitlines())} lines:\n{ran.stdout}"
    # The fixes as printed, pasted from another directory: then the draft is served as trained.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PYTHONPATH"] = str(ROOT)   # this checkout's package, as in the environment the commands name
    for command in fix_commands(printed_verdict(ran.stdout)):
        done = subprocess.run(command, shell=True, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\nexit {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    assert "VERDICT: served as trained" in done.stdout, done.stdout[-3000:]


# ---------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", FENCE.sub("", text), re.M)}


def broken_links(text: str, where: Path) -> list[str]:
    """Each relative link of a markdown text (outside code blocks) whose file, or heading, does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (where / path).resolve() if path else None
        if file is not None and not file.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(file.read_text() if file else text):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page.read_text(), page.parent) == []


def test_a_broken_link_is_caught():
    planted = ("# Top\n\n[fine](README.md) [web](https://example.org/x.md) [here](#top) [code](conformance)\n"
               "[gone](docs/no-such-page.md) [no heading](README.md#no-such-heading) [not here](#nowhere)\n"
               "```\n[in a code block](not-a-link.md)\n```\n")
    assert broken_links(planted, ROOT) == ["docs/no-such-page.md", "README.md#no-such-heading", "#nowhere"]
