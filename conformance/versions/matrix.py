"""The version matrix: one environment per release under test, and the CPU conformance lane run in each.

The releases are the adapters' own (`releases` on each adapter in conformance/adapters); the release
the lock pins runs in the project's environment as it is. Every other release is installed with
`pip install --no-deps --target .venv-releases/<package>-<version>` over that environment and put
first on PYTHONPATH, so that the lock's torch, transformers and every other package stay exactly as
pinned and only the package under test changes. A release that needs other versions of some packages
gets a small lock of those alone (`requirements-<package>-<version>.lock`), installed into the same
directory.

Each lane writes its report to report/versions/<package>-<version>/ and `lane.json` beside it: which
release ran (read back from the report's own versions), the time and size of its environment, the
time of the lane and pytest's counts; lane.log holds pytest's output.
`python -m conformance.versions --help` lists the commands.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(".venv-releases")          # relative to the repository root (.gitignore'd)
REPORTS = Path("report") / "versions"
LOCK = "requirements.lock"
LANE_MARK = "cpu and not meta"
LANE_FILE = "lane.json"
LOG_FILE = "lane.log"          # pytest's whole output, beside the report
BUILT_FILE = ".built.json"
COUNTS = re.compile(r"(\d+) (passed|failed|xfailed|xpassed|skipped|errors?|deselected)")


class ReleaseError(ValueError):
    """A release spec or environment the matrix cannot use (one line)."""


@dataclass(frozen=True, order=True)
class Release:
    package: str
    version: str

    def __str__(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def slug(self) -> str:
        return f"{self.package}-{self.version}"

    @property
    def extra_lock(self) -> Path:
        """The release's own lock of the packages it needs in other versions than requirements.lock."""
        return Path(f"requirements-{self.slug}.lock")


def under_test() -> list[Release]:
    """Every release the suite is tested against of each implementation of the CPU lane, in adapter order
    (an implementation with a lane and environment of its own, e.g. vLLM, is tested in that lane)."""
    from conformance.adapters import ADAPTERS, IMPLEMENTATIONS

    return [Release(ADAPTERS[i].package, v) for i in IMPLEMENTATIONS if ADAPTERS[i].package
            for v in ADAPTERS[i].releases]


def parse(spec: str) -> Release:
    """'sglang==0.5.22' -> Release; only a release under test is accepted."""
    package, sep, version = spec.strip().partition("==")
    if not sep or not package or not version:
        raise ReleaseError(f"RELEASE {spec!r}: expected PACKAGE==VERSION, e.g. sglang==0.5.22")
    try:
        Version(version)
    except InvalidVersion:
        raise ReleaseError(f"RELEASE {spec!r}: {version!r} is not a version") from None
    release = Release(package.strip(), version.strip())
    known = under_test()
    if release not in known:
        same = [r.version for r in known if r.package == release.package]
        raise ReleaseError(f"RELEASE {spec!r}: not a release under test"
                           + (f" ({release.package}: {', '.join(same)})" if same else
                              f" (packages: {', '.join(sorted({r.package for r in known}))})"))
    return release


def pinned(root: Path = ROOT) -> dict[str, str]:
    """package -> version, as requirements.lock pins it."""
    out = {}
    for line in (root / LOCK).read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[name.strip().lower()] = version.strip()
    return out


def is_pinned(release: Release, root: Path = ROOT) -> bool:
    return pinned(root).get(release.package.lower()) == release.version


def env_dir(release: Release, root: Path = ROOT) -> Path | None:
    """The --target directory of a release (None: the lock's own release, in the project's environment)."""
    return None if is_pinned(release, root) else root / ENVS / release.slug


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def build(release: Release, python: str = sys.executable, root: Path = ROOT) -> dict:
    """Install the release (and its own lock, if any) into its directory; a directory already built for
    the same release is kept. Returns what the build took: {seconds, bytes, packages}."""
    target = env_dir(release, root)
    if target is None:
        return {"seconds": 0.0, "bytes": 0, "packages": [], "note": f"pinned in {LOCK}: the project's environment"}
    marker = target / BUILT_FILE
    if marker.exists():
        built = json.loads(marker.read_text())
        if built.get("release") == str(release):
            return built
    requirements = [str(release)]
    lock = root / release.extra_lock
    if lock.exists():
        requirements += ["-r", str(lock)]
    started = time.monotonic()
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--upgrade",
           "--target", str(target), *requirements]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ReleaseError(f"{release}: pip install --target {target.relative_to(root)} failed: {tail}")
    built = {"release": str(release), "seconds": round(time.monotonic() - started, 1), "bytes": dir_size(target),
             "packages": requirements}
    marker.write_text(json.dumps(built, indent=1) + "\n")
    return built


def lane_env(release: Release, root: Path = ROOT) -> dict[str, str]:
    """The environment of a lane: the release's directory first on PYTHONPATH."""
    env = dict(os.environ)
    target = env_dir(release, root)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    return env


def imported_version(release: Release, python: str = sys.executable, root: Path = ROOT) -> str:
    """The version of the release's package the lane's interpreter sees (its metadata, as report.json records)."""
    code = f"from importlib import metadata; print(metadata.version({release.package!r}))"
    done = subprocess.run([python, "-c", code], cwd=root, env=lane_env(release, root), capture_output=True, text=True)
    return done.stdout.strip() or f"(none: {(done.stderr.strip().splitlines() or [''])[-1]})"


def counts(pytest_output: str) -> dict[str, int]:
    """pytest's final counts ('3 failed, 10 passed, 2 xfailed in 9.1s') as {outcome: n}."""
    last = next((line for line in reversed(pytest_output.splitlines()) if COUNTS.search(line)), "")
    return {("errors" if what.startswith("error") else what): int(n) for n, what in COUNTS.findall(last)}


@dataclass
class LaneResult:
    release: str          # what was asked for
    ran: str              # the version the lane's report.json records for the package
    returncode: int
    seconds: float
    counts: dict
    env: dict             # build(): seconds, bytes, packages
    report: str           # the report directory, relative to the repository root

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.ran == self.release.partition("==")[2]


def run_lane(release: Release, python: str = sys.executable, root: Path = ROOT, reports: Path = REPORTS,
             pytest_args: tuple[str, ...] = ()) -> LaneResult:
    """Build the release's environment, run the CPU conformance lane in it, record lane.json."""
    env_info = build(release, python, root)
    seen = imported_version(release, python, root)
    if seen != release.version:
        raise ReleaseError(f"{release}: the lane's interpreter imports {release.package} {seen} "
                           f"(environment {env_dir(release, root)})")
    out_dir = reports / release.slug
    cmd = [python, "-m", "pytest", "-m", LANE_MARK, "-q", "-p", "no:cacheprovider",
           f"--report={out_dir}", *pytest_args]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=root, env=lane_env(release, root), capture_output=True, text=True)
    seconds = round(time.monotonic() - started, 1)
    sys.stdout.write(done.stdout[-4000:])
    sys.stderr.write(done.stderr[-2000:])
    report_json = (root / out_dir if not out_dir.is_absolute() else out_dir) / "report.json"
    ran = json.loads(report_json.read_text())["versions"].get(release.package, "?") if report_json.exists() else "?"
    result = LaneResult(str(release), ran, done.returncode, seconds, counts(done.stdout), env_info, str(out_dir))
    report_json.parent.mkdir(parents=True, exist_ok=True)
    (report_json.parent / LANE_FILE).write_text(json.dumps(asdict(result), indent=1) + "\n")
    (report_json.parent / LOG_FILE).write_text(done.stdout + done.stderr)
    return result


def same_lane(result: LaneResult, release: Release, reports: Path = REPORTS, root: Path = ROOT) -> LaneResult:
    """The pinned releases all run in the project's environment: one lane is theirs, recorded under each."""
    ran = json.loads((root / result.report / "report.json").read_text())["versions"].get(release.package, "?") \
        if (root / result.report / "report.json").exists() else "?"
    same = LaneResult(str(release), ran, result.returncode, result.seconds, result.counts, result.env, result.report)
    out = (root / reports / release.slug) if not reports.is_absolute() else reports / release.slug
    out.mkdir(parents=True, exist_ok=True)
    (out / LANE_FILE).write_text(json.dumps(asdict(same), indent=1) + "\n")
    return same


def summary(reports: Path = REPORTS, root: Path = ROOT) -> str:
    """A markdown table of every lane.json under `reports`."""
    rows = []
    base = reports if reports.is_absolute() else root / reports
    for path in sorted(base.glob(f"*/{LANE_FILE}")):
        r = json.loads(path.read_text())
        c = r["counts"]
        rows.append(f"| {r['release']} | {r['ran']} | {r['env'].get('seconds', 0):.0f} s | "
                    f"{r['env'].get('bytes', 0) / 2**20:.0f} MiB | {r['seconds']:.0f} s | "
                    f"{c.get('passed', 0)} passed, {c.get('xfailed', 0)} xfailed, {c.get('failed', 0)} failed"
                    f"{', %d errors' % c['errors'] if c.get('errors') else ''} | "
                    f"{'pass' if r['returncode'] == 0 else 'FAIL'} |")
    head = ["| release | ran | env build | env size | lane | tests | lane result |", "|---|---|---|---|---|---|---|"]
    return "\n".join(head + rows)
