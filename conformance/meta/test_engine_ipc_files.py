"""The engine lane leaves no files of SGLang's behind (engine.ipc_names_in, EngineLane's check after shutdown).

SGLang names its IPC sockets with tempfile.NamedTemporaryFile(delete=False) and never removes them
(server_args.py:781-811): before the adjustment, every engine of the lane left four or five files in the host's temp
directory. The lane's test (engine/test_engine.py::test_an_engine_leaves_no_files_behind) checks the real engines;
here the redirection itself and the check's two failures, planted.
"""
from __future__ import annotations

import tempfile

import pytest

from conformance.adapters import ADAPTERS, DEFAULT_SERVER
from conformance.engine.lane import GroupRun
from conformance.engine.scenarios import GROUPS

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def test_ipc_names_are_made_in_the_engines_directory_and_tempfile_is_restored(tmp_path):
    before = tempfile.tempdir
    with ADAPTERS[DEFAULT_SERVER].engine.ipc_names_in(str(tmp_path)):
        name = tempfile.NamedTemporaryFile(delete=False).name   # as PortArgs.init_new names a socket
    assert tempfile.tempdir == before
    assert [p.name for p in tmp_path.iterdir()] == [name.rsplit("/", 1)[1]]


def test_the_check_names_files_made_elsewhere_or_left_behind(tmp_path):
    group = GROUPS[0]
    own = tmp_path / "ipc"
    own.mkdir()
    inside, elsewhere = str(own / "tmpa"), str(tmp_path / "tmpb")
    assert GroupRun(group, ipc_dir=str(own), ipc_paths=(inside,)).leftovers_failure() is None
    made_elsewhere = GroupRun(group, ipc_dir=str(own), ipc_paths=(inside, elsewhere)).leftovers_failure()
    assert made_elsewhere and f"engine {group.id}" in made_elsewhere and elsewhere in made_elsewhere
    left = GroupRun(group, ipc_dir=str(own), ipc_paths=(inside,), left_behind=(str(own),)).leftovers_failure()
    assert left and "left after shutdown" in left and str(own) in left
