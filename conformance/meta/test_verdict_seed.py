"""The verdict as a user gets it, continued from test_verdict.py: a clean draft in every format SGLang reads as
written exits 0 "served as trained"; the seed from files (trained on [embed, 3, 31], config.json rewritten to
ids SGLang turns into [3, 31, 59] on the real Kimi-K2.5 config) is exactly that slot-by-slot problem, and the
draft rewired as the verdict says exits 0; the seed's server flags on a user draft show the 16 -> 2 draft tokens.
"""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from conformance.meta.verdict_runs import CLEAN, SEED, check_verdict, start_runs

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    yield from start_runs(tmp_path_factory.mktemp("verdict_seed"), CLEAN + SEED)


@pytest.mark.parametrize("case", CLEAN + SEED, ids=lambda c: c.id)
def test_the_verdict_names_the_problem(case, runs):
    check_verdict(case, runs)
