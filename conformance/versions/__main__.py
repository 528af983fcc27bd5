"""`python -m conformance.versions list | build RELEASE | lane RELEASE | matrix | summary`.

Exit status: 0 every lane passed and ran the release it was asked for, 1 a lane failed, 4 bad input
(a one-line error on stderr)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.versions import matrix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.versions", description=__doc__)
    parser.add_argument("command", choices=("list", "build", "lane", "matrix", "summary"))
    parser.add_argument("release", nargs="?", help="PACKAGE==VERSION (build, lane)")
    parser.add_argument("--reports", default=str(matrix.REPORTS), help="where each lane's report goes (one dir each)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the lanes")
    parser.add_argument("--only", default="", help="matrix: only these packages (comma-separated)")
    args, pytest_args = parser.parse_known_args(argv)
    reports = Path(args.reports)
    try:
        if args.command == "list":
            for r in matrix.under_test():
                where = matrix.env_dir(r)
                print(f"{r}\t{'pinned (project environment)' if where is None else where.relative_to(matrix.ROOT)}")
            return 0
        if args.command == "summary":
            print(matrix.summary(reports))
            return 0
        if args.command in ("build", "lane") and not args.release:
            raise matrix.ReleaseError(f"{args.command}: give RELEASE, e.g. sglang==0.5.22")
        releases = matrix.under_test() if args.command == "matrix" else [matrix.parse(args.release)]
        if args.only:
            releases = [r for r in releases if r.package in args.only.split(",")]
            if not releases:
                raise matrix.ReleaseError(f"--only {args.only}: no release under test "
                                          f"(packages: {', '.join(sorted({r.package for r in matrix.under_test()}))})")
        if args.command == "build":
            print(matrix.build(releases[0], args.python))
            return 0
        results, pinned_lane = [], None
        for r in releases:
            if matrix.env_dir(r) is None and pinned_lane is not None:   # the same environment, the same lane
                results.append(matrix.same_lane(pinned_lane, r, reports))
                continue
            results.append(matrix.run_lane(r, args.python, reports=reports, pytest_args=tuple(pytest_args)))
            if matrix.env_dir(r) is None:
                pinned_lane = results[-1]
    except matrix.ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 4
    print(matrix.summary(reports))
    for r in results:
        if not r.ok:
            print(f"FAILED: {r.release} (ran {r.ran}, pytest exit {r.returncode}); report {r.report}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
