"""executor_svc/link.py IncarnationFile: what an executor's own probe reads
(deploy/probe.py executor --incarnation-file)."""

from __future__ import annotations

import logging

from deploy.probe import own_incarnation
from executor_svc.link import IncarnationFile


def test_each_hello_replaces_the_file_whole_and_a_stop_removes_it(tmp_path):
    path = tmp_path / "executor.incarnation"
    marker = IncarnationFile(str(path))
    assert own_incarnation(str(path))[0] is None
    marker("first")
    marker("second")  # a re-registration under a new incarnation
    assert own_incarnation(str(path)) == ("second", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left
    marker.remove()
    marker.remove()  # twice is fine
    incarnation, why = own_incarnation(str(path))
    assert incarnation is None and "no Hello yet" in why


def test_an_unwritable_path_is_logged_not_fatal(tmp_path, caplog):
    marker = IncarnationFile(str(tmp_path / "missing-dir" / "executor.incarnation"))
    with caplog.at_level(logging.WARNING):
        marker("abc")
    assert "cannot write the incarnation file" in caplog.text
    assert own_incarnation(str(tmp_path / "missing-dir" / "executor.incarnation"))[0] is None


def test_an_empty_file_is_no_incarnation(tmp_path):
    path = tmp_path / "executor.incarnation"
    path.write_text("\n")
    incarnation, why = own_incarnation(str(path))
    assert incarnation is None and "empty" in why
