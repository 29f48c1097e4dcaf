"""The uploaded project's files, seen from the job's shared work directory (the workers' cwd).

Workers start in the job's work directory on the shared filesystem, so that a script's relative
outputs (``snapshot.pt``) are one file for every node. A project directory (``run-job ./project
-- train.py``) is unpacked on each node into ``$PETCTL_AGENT_DIR/code``, elsewhere: a relative
read such as ``open("data/input.txt")`` found nothing. :func:`link_project` makes, before every
(re)start of the workers, a symbolic link in the work directory for each top-level entry of the
project, pointing at this node's copy (``work/data -> /var/lib/petctl/code/data``). So, as under
``cd project && torchrun train.py``:

- a relative read finds the project's file, read from the node's own disk;
- a relative write of a new name lands in the shared work directory.

The rule for a name that is both a project entry and a file the job writes:

- the work directory's own file wins: a real file or directory of that name there (the job wrote
  it, in this run or an earlier run of the job's name) is never linked over, and every node
  reads it;
- otherwise the name is a link to the node's copy of the project. Writing *through* it
  (``torch.save(obj, "snapshot.pt")`` when the project ships ``snapshot.pt``) changes this
  node's copy only. To make such an output shared, replace the link: write a temporary file and
  ``os.replace`` it onto the name (the checkpoint helper saves that way); from then on the job's
  file wins on every node. Simplest: ship no file under an output's name.

Every node's agent path is the same on AWS (``/var/lib/petctl``), so every node's link has the
same target and resolves on each node to its own copy. On the local cloud each instance has its
own root: a link points at the copy of the node that made it last (the same run's files); each
node points it at its own at its workers' start. A link of an earlier run of the job's name whose
entry the project no longer has is removed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("petctl_agent")


@dataclass
class Linked:
    """What :func:`link_project` did: names linked (or re-pointed), kept as they were, shadowed
    by the job's own file, and stale links removed."""

    made: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    shadowed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def _stale(link: Path, code_dir: Path, names: set[str]) -> bool:
    """A link a node made for a project entry this project no longer has (an earlier run's)."""
    if link.name in names:
        return False
    try:
        target = os.readlink(link)
    except OSError:
        return False
    ours = target == str(code_dir / link.name)
    a_node_copy = Path(target).parent.name == code_dir.name and Path(target).name == link.name
    return ours or (a_node_copy and not os.path.exists(link))


def _point(dest: Path, target: str) -> None:
    """Make ``dest`` a link to ``target``: a new name with ``symlink`` (never over a file that
    appeared meanwhile), an existing link replaced atomically."""
    if not os.path.lexists(dest):
        try:
            os.symlink(target, dest)
            return
        except FileExistsError:
            if not dest.is_symlink():
                raise
    tmp = dest.with_name(f".{dest.name}.petctl-link.{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    os.replace(tmp, dest)


def link_project(code_dir: Path, work_dir: Path) -> Linked:
    """Link each top-level entry of ``code_dir`` (this node's copy of the project) into
    ``work_dir`` (the job's shared work directory), by the rule above. Idempotent; call it before
    every start of the workers."""
    code_dir, work_dir = Path(code_dir).absolute(), Path(work_dir)
    out = Linked()
    entries = sorted(p.name for p in code_dir.iterdir()) if code_dir.is_dir() else []
    for name in entries:
        dest, target = work_dir / name, str(code_dir / name)
        if dest.is_symlink():
            if os.readlink(dest) == target:
                out.kept.append(name)
                continue
        elif os.path.lexists(dest):
            out.shadowed.append(name)  # the job's own file or directory wins
            continue
        try:
            _point(dest, target)
            out.made.append(name)
        except FileExistsError:
            out.shadowed.append(name)  # the job wrote it just now
    names = set(entries)
    try:
        links = [p for p in work_dir.iterdir() if p.is_symlink()]
    except OSError:
        links = []
    for link in links:
        if _stale(link, code_dir, names):
            try:
                os.unlink(link)
                out.removed.append(link.name)
            except OSError:
                pass
    return out


def link_and_log(code_dir: Path, work_dir: Path) -> Linked | None:
    """:func:`link_project`, logged; never raises (a failure here must not stop a restart: a
    read of a project file then fails in the script, and its reason says so)."""
    try:
        got = link_project(code_dir, work_dir)
    except OSError as e:
        log.warning("could not link the project's files into the work dir %s: %s", work_dir, e)
        return None
    if got.made or got.removed:
        log.info(
            "project files in the work dir %s: linked %s%s",
            work_dir,
            ", ".join(got.made) or "nothing new",
            f"; removed stale links {', '.join(got.removed)}" if got.removed else "",
        )
    if got.shadowed:
        log.info(
            "the work dir's own %s shadow%s the project's (the job's files win)",
            ", ".join(got.shadowed),
            "s" if len(got.shadowed) == 1 else "",
        )
    return got
