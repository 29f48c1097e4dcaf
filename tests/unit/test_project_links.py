"""A project's files seen from the job's shared work dir (``petctl_agent.worker.project``):
links to the node's copy, made at every worker start, and the job's own files win."""

from __future__ import annotations

import os
from pathlib import Path

from petctl_agent.worker.project import link_and_log, link_project


def _project(root: Path) -> Path:
    code = root / "node-a" / "code"
    (code / "data").mkdir(parents=True)
    (code / "data" / "input.txt").write_text("hello\n")
    (code / "train.py").write_text("print('hi')\n")
    (code / "snapshot.pt").write_bytes(b"shipped")
    return code


def test_relative_reads_find_the_project_and_writes_stay_in_the_work_dir(tmp_path: Path) -> None:
    code, work = _project(tmp_path), tmp_path / "work"
    work.mkdir()
    got = link_project(code, work)
    assert got.made == ["data", "snapshot.pt", "train.py"] and not got.shadowed
    assert os.readlink(work / "data") == str(code / "data")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert open("data/input.txt").read() == "hello\n"  # noqa: SIM115 - as a script reads it
        Path("outputs").mkdir()
        Path("outputs/result.txt").write_text("shared")  # a new name: the work dir itself
    finally:
        os.chdir(cwd)
    assert (work / "outputs" / "result.txt").read_text() == "shared" and not (code / "outputs").exists()
    # again (the next worker start): nothing changes
    again = link_project(code, work)
    assert again.kept == ["data", "snapshot.pt", "train.py"] and not again.made


def test_the_job_s_own_file_wins_over_the_project_s(tmp_path: Path) -> None:
    """A name the project ships and the job writes: once the work dir holds a real file of that
    name (an atomic save replaced the link), it is never linked over."""
    code, work = _project(tmp_path), tmp_path / "work"
    work.mkdir()
    link_project(code, work)
    tmp = work / "snapshot.pt.tmp"
    tmp.write_bytes(b"epoch 3")
    os.replace(tmp, work / "snapshot.pt")  # the save: temp file + rename replaces the link
    got = link_project(code, work)
    assert got.shadowed == ["snapshot.pt"] and (work / "snapshot.pt").read_bytes() == b"epoch 3"
    assert (code / "snapshot.pt").read_bytes() == b"shipped"  # the node's copy untouched
    # a job's own directory of a project name wins too
    (work / "data").unlink()
    (work / "data").mkdir()
    assert "data" in link_project(code, work).shadowed and not (work / "data").is_symlink()


def test_links_follow_this_node_s_copy_and_an_earlier_run_s_are_removed(tmp_path: Path) -> None:
    code, work = _project(tmp_path), tmp_path / "work"
    work.mkdir()
    # an earlier run of the job's name (another node's copy, gone): an entry this project lacks,
    # and one it has
    old = tmp_path / "node-old" / "code"
    os.symlink(old / "vocab.json", work / "vocab.json")
    os.symlink(old / "data", work / "data")
    os.symlink("/elsewhere/notes.txt", work / "notes.txt")  # the user's own link: kept
    got = link_project(code, work)
    assert got.removed == ["vocab.json"] and "data" in got.made
    assert os.readlink(work / "data") == str(code / "data")
    assert (work / "notes.txt").is_symlink()
    # another node (the local cloud: its own root) points the links at its own copy
    other = tmp_path / "node-b" / "code"
    other.mkdir(parents=True)
    (other / "data").mkdir()
    got = link_project(other, work)
    assert got.made == ["data"] and os.readlink(work / "data") == str(other / "data")
    assert os.readlink(work / "train.py") == str(code / "train.py")  # not in b's copy: left


def test_a_failure_to_link_never_raises(tmp_path: Path) -> None:
    code = _project(tmp_path)
    assert link_and_log(code, tmp_path / "no-such-work-dir") is None
    assert link_and_log(tmp_path / "no-code", tmp_path).made == []
