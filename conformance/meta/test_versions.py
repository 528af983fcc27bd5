"""The version matrix (conformance/versions) and the per-release support matrix: releases are parsed and
refused in one line, a lane runs the release it was asked for (or fails), ranges sort as versions, and the
support matrix (docs/registry.md) is evaluated per release from the registry, whatever is installed."""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import ClassVar

import pytest
from packaging.specifiers import SpecifierSet

from conformance.adapters import ADAPTERS
from conformance.adapters.base import supported_range
from conformance.core import registry
from conformance.session import support_matrix
from conformance.versions import matrix
from conformance.versions.__main__ import main

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


@pytest.mark.parametrize("spec, says", [
    ("sglang", "expected PACKAGE==VERSION"),
    ("sglang==", "expected PACKAGE==VERSION"),
    ("sglang==abc", "'abc' is not a version"),
    ("sglang==0.4.0", "not a release under test (sglang: 0.5.20"),
    ("nothing==1.0", "not a release under test (packages: "),
])
def test_a_bad_release_is_one_line(spec, says, capsys):
    with pytest.raises(matrix.ReleaseError) as info:
        matrix.parse(spec)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert main(["lane", spec]) == 4
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: RELEASE") and len(err.splitlines()) == 1


def test_a_matrix_of_no_known_package_is_one_line(capsys):
    assert main(["matrix", "--only", "nothing"]) == 4
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --only nothing: no release under test") and len(err.splitlines()) == 1


def test_every_adapter_release_is_in_the_matrix_and_in_its_range():
    releases = matrix.under_test()
    for adapter in ADAPTERS.values():
        mine = [r.version for r in releases if r.package == adapter.package]
        # The CPU lane's implementations are the matrix's; one with its own lane (vLLM) is tested there.
        assert mine == (list(adapter.releases) if adapter.lane == "cpu" and adapter.package else [])
        if adapter.releases:
            spec = SpecifierSet(supported_range(adapter))
            assert all(v in spec for v in adapter.releases)
    assert supported_range(ADAPTERS["reference"]) == ""


def test_the_supported_range_sorts_releases_as_versions():
    class Planted:   # 0.5.9 sorts after 0.5.20 as a string
        releases: ClassVar[tuple[str, ...]] = ("0.5.20", "0.5.9", "0.5.10")

    assert supported_range(Planted) == ">=0.5.9,<=0.5.20"


def test_the_pinned_release_runs_in_the_project_environment_and_others_first_on_the_path(tmp_path):
    (tmp_path / matrix.LOCK).write_text("torch==2.14.1\nplanted-pkg==1.0  # a comment\n")
    pinned, other = matrix.Release("planted-pkg", "1.0"), matrix.Release("planted-pkg", "0.9")
    assert matrix.env_dir(pinned, tmp_path) is None
    assert matrix.env_dir(other, tmp_path) == tmp_path / matrix.ENVS / "planted-pkg-0.9"
    # What the lane's interpreter imports: the release's directory wins over the environment.
    target = matrix.env_dir(other, tmp_path)
    info = target / "planted_pkg-0.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-pkg\nVersion: 0.9\n")
    assert matrix.imported_version(other, sys.executable, tmp_path) == "0.9"
    assert matrix.imported_version(pinned, sys.executable, tmp_path).startswith("(none")


def test_a_lane_that_ran_another_release_is_not_ok():
    ran = matrix.LaneResult("sglang==0.5.22", "0.5.22", 0, 1.0, {}, {}, "r")
    assert ran.ok
    assert not dataclasses.replace(ran, ran="0.5.23").ok
    assert not dataclasses.replace(ran, returncode=1).ok


def test_pytest_counts_are_read_from_its_last_line():
    out = "x.F\nFAILED a::b\n3 failed, 280 passed, 4 skipped, 142 xfailed, 1 error in 148.70s (0:02:28)\n"
    assert matrix.counts(out) == {"failed": 3, "passed": 280, "skipped": 4, "xfailed": 142, "errors": 1}


def test_the_summary_names_what_ran(tmp_path):
    lane = matrix.LaneResult("sglang==0.5.22", "0.5.22", 1, 164.0, {"passed": 280, "failed": 2},
                             {"seconds": 14.0, "bytes": 201 * 2**20}, "r")
    (tmp_path / "sglang-0.5.22").mkdir()
    (tmp_path / "sglang-0.5.22" / matrix.LANE_FILE).write_text(json.dumps(dataclasses.asdict(lane)))
    row = matrix.summary(tmp_path).splitlines()[-1]
    assert row == "| sglang==0.5.22 | 0.5.22 | 14 s | 201 MiB | 164 s | 280 passed, 0 xfailed, 2 failed | FAIL |"


# ---------------------------------------------------------------- the per-release support matrix

def _entry(area: str, impl: str) -> registry.Known:
    return next(e for e in registry.REGISTRY if e.area == area and e.impl == impl)


def test_each_release_column_is_the_registry_at_that_release(monkeypatch):
    """An entry narrowed to one release shows in that release's column only, whatever is installed."""
    entry = _entry("settings", "sglang")
    releases = support_matrix.releases("sglang")
    narrowed = dataclasses.replace(entry, versions=f"=={releases[0]}")
    monkeypatch.setattr(registry, "REGISTRY", tuple(narrowed if e is entry else e for e in registry.REGISTRY))
    row = next(r for r in support_matrix.settings_rows() if r["entry"] == entry.id)
    assert [row[support_matrix.column("sglang", r)] for r in releases] == ["yes"] + ["no"] * (len(releases) - 1)


def test_draft_columns_follow_the_release(monkeypatch):
    entry = _entry("draft", "sglang")
    releases = support_matrix.releases("sglang")
    narrowed = dataclasses.replace(entry, versions=f"=={releases[-1]}")
    monkeypatch.setattr(registry, "REGISTRY", tuple(narrowed if e is entry else e for e in registry.REGISTRY))
    rows = support_matrix.draft_rows()
    shown = {r["case"]: [r[support_matrix.column("sglang", v)] for v in releases] for r in rows}
    hit = [case for case, cells in shown.items() if f"({entry.id})" in cells[-1]]
    assert hit, f"{entry.id} decides no case at {releases[-1]}"
    assert all(f"({entry.id})" not in cell for case in hit for cell in shown[case][:-1])


def test_the_readme_matrix_goes_stale_when_a_range_changes(monkeypatch):
    """The staleness self-test (test_registry.py) compares docs/registry.md with doc_block(): a range that
    changes one release's column changes the block."""
    current = support_matrix.doc_block()
    entry = _entry("settings", "sglang")
    monkeypatch.setattr(registry, "REGISTRY", tuple(
        dataclasses.replace(e, versions=f"=={support_matrix.releases('sglang')[0]}") if e is entry else e
        for e in registry.REGISTRY))
    assert support_matrix.doc_block() != current
    assert support_matrix.doc_block() not in support_matrix.DOC.read_text()
