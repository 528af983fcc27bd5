"""The README's "your draft" commands, run as a user runs them, and the links of README.md and docs/*.md.

The quick start's `make check` line is a template; the "A real verdict" block is that line filled in for the
tiny example draft, and the same generator line before it. Those commands run here in subprocesses, from the
repository root, on the draft the generator writes (into a temporary directory instead of out/): each must
exit with the code its comment claims, and the verdict it prints must be the block pasted under it, line for
line, except the `versions:` line, which names the environment that ran. Every relative link of README.md and
docs/*.md must name a file that exists (and a heading of it, for an anchor); a planted broken link shows the
checker can fail.
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
QUICK_START, REAL_VERDICT = "## Quick start", "### A real verdict"
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


def test_the_quick_start_is_the_real_verdicts_command_filled_in():
    quick = commands(QUICK_START)
    quick_generator = next(words for words, _ in quick if GENERATOR in words)
    quick_check = make_variables(next(words for words, _ in quick if words[:2] == ["make", "check"]))
    generator, _, check, _ = real_verdict()
    assert quick_generator == generator, "the quick start and the real verdict write the example differently"
    assert all(PLACEHOLDER.search(value) for value in quick_check.values()), quick_check
    filled = make_variables(check)
    assert set(quick_check) <= set(filled), f"the real verdict leaves out {set(quick_check) - set(filled)}"
    assert filled["DRAFT"] == f"{generator[-1]}/draft", "the real verdict checks another draft than it writes"
    assert not any(PLACEHOLDER.search(value) for value in filled.values()), filled


def pasted_verdict() -> list[str]:
    """The verdict block pasted under the real verdict's commands, without its `...` cut marks."""
    block = next(b for b in blocks_under(REAL_VERDICT) if "VERDICT: " in b)
    return [line for line in block.splitlines() if line.strip() != "..."]


def printed_verdict(stdout: str) -> list[str]:
    """The verdict at the end of a run: from its headline to the short test summary."""
    lines = stdout[stdout.index("VERDICT: "):].splitlines()
    return lines[:next((i for i, line in enumerate(lines) if line.startswith("====")), len(lines))]


def without_versions(lines: list[str]) -> list[str]:
    found = [line for line in lines if line.startswith("  versions: ")]
    assert len(found) == 1, lines
    return [line for line in lines if not line.startswith("  versions: ")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readme_verdict_commands_exit_as_the_readme_says(tmp_path):
    generator, generated, check, checked = real_verdict()
    out = generator[-1]
    here = str(tmp_path / out)

    def local(word: str) -> str:   # the README's out/... path, in the temporary directory
        return re.sub(rf"(^|=){re.escape(out)}(?=/|$)", lambda m: m.group(1) + here, word)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # .venv/bin/python is this environment in a clone; so is make's VENV, which make must not rebuild (-o):
    # the environment the suite runs in is the one under test, and a shared one is never reinstalled from here.
    assert generator[0] == ".venv/bin/python", generator
    wrote = subprocess.run([sys.executable, *map(local, generator[1:])], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert wrote.returncode == generated, wrote.stdout + wrote.stderr
    assert (Path(here) / "draft" / "config.json").is_file(), wrote.stdout

    venv = sys.prefix
    assert check[0] == "make", check
    argv = ["make", "-o", f"{venv}/.installed", *map(local, check[1:]), f"VENV={venv}", f"REPORT={tmp_path / 'report'}"]
    ran = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (ran.stdout + ran.stderr)[-3000:]
    # make exits 2 whenever pytest does not exit 0, and names pytest's code on its last line (the README says so)
    if checked == 0:
        assert ran.returncode == 0, tail
    else:
        assert ran.returncode == 2, tail
        # make[1]: when this runs under `make test` (a make inside a make names its level)
        assert re.search(rf"make(\[\d+\])?: \*\*\* \[\S+: check\] Error {checked}$", ran.stderr.strip()), tail
    assert without_versions(printed_verdict(ran.stdout)) == without_versions(pasted_verdict()), tail


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
