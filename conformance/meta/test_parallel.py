"""Parallel runs (conformance/session/parallel.py): a report merged from several processes is the report one
process writes, and the engine lane's files are scheduled as one unit."""
from __future__ import annotations

import json

import pytest

from conformance.session.parallel import scope
from conformance.session.report import Report
from conformance.core.sections import Section

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROWS = [(Section.WIRING, {"target": "llama", "slots": (2, 4, 5), "ok": True}),
        (Section.TRAINED_DRAFT, {"steps": 3, "accuracy": 0.5}),
        (Section.WIRING, {"target": "qwen3", "slots": (1, 4, 5), "ok": False})]
FAILURES = [("speculators", "tied_embeddings", "fp32", "a.py::t[x]", "KNOWN", "lm_head.weight never loaded"),
            ("sglang", "gqa", "bf16", "b.py::t[y]", "PASS", "")]


def fill(report: Report, rows, failures) -> Report:
    for section, row in rows:
        report.add_row(section, row)
    for failure in failures:
        report.add_load_failure(*failure)
    return report


def rendered(report: Report) -> str:
    return json.dumps(report.to_json(), indent=1)


def test_a_report_merged_from_workers_equals_one_process_report():
    one = fill(Report(), ROWS, FAILURES)
    controller = fill(Report(), ROWS[2:], FAILURES[1:])        # the controller ran some tests itself
    worker = fill(Report(), ROWS[:2], FAILURES[:1])
    controller.absorb(json.loads(json.dumps(worker.parts())))   # as pytest_testnodedown receives it
    assert rendered(controller) == rendered(one)
    # planted: a worker's findings that never reach the controller change the report
    lost = fill(Report(), ROWS[2:], FAILURES[1:])
    assert rendered(lost) != rendered(one), "a report missing a worker's rows must differ"


def test_the_engine_lane_is_one_scope_and_other_files_their_own():
    assert scope("conformance/engine/test_engine.py::test_a[x]") == scope("conformance/engine/test_engine_faults.py::t")
    assert scope("conformance/draft/test_step0.py::t[a]") == scope("conformance/draft/test_step0.py::u")
    assert scope("conformance/draft/test_step0.py::t") != scope("conformance/draft/test_multistep.py::t")
    assert scope("conformance/draft/test_step0.py::t") != scope("conformance/engine/test_engine.py::t")


def test_the_acceptance_lane_is_handed_out_first():
    """xdist orders files by their number of tests, which ran the acceptance lane (few tests, the longest file of
    `make conformance`) last and alone. Planted in xdist's order, the first unit sent to a worker is the acceptance
    lane, then the others in xdist's order."""
    from collections import OrderedDict

    from conformance.session.parallel import FileGroupScheduling

    files = {"conformance/draft/test_step0.py": 248, "conformance/user/test_user_serving.py": 12,
             "conformance/acceptance/test_acceptance.py": 9}
    collection = [f"{path}::t[{i}]" for path, n in files.items() for i in range(n)]

    class Worker:
        def __init__(self):
            self.sent = []

        def send_runtest_some(self, indexes):
            self.sent.append({collection[i].split("::")[0] for i in indexes})

    sched = FileGroupScheduling.__new__(FileGroupScheduling)   # its state, without a pytest session behind it
    worker = Worker()
    sched.assigned_work, sched.registered_collections = {}, {worker: collection}
    by_count = sorted(files, key=lambda path: -files[path])    # xdist's own order (loadscopereorder)
    sched.workqueue = OrderedDict((path, {n: False for n in collection if n.startswith(path)}) for path in by_count)
    assert list(sched.workqueue)[-1] == "conformance/acceptance/test_acceptance.py"
    for _ in files:
        sched._assign_work_unit(worker)
    assert worker.sent == [{"conformance/acceptance/test_acceptance.py"}, {"conformance/draft/test_step0.py"},
                           {"conformance/user/test_user_serving.py"}], worker.sent
