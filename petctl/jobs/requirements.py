"""A job's requirements: found, read and checked before anything is created.

A ``requirements.txt`` at the top of a project directory, or ``run-job --requirements FILE``, is
pip's requirements format; every node installs it after torch into the job's environment
(petctl_agent/node/jobenv.py), with pip run in the node's copy of the project, as under ``cd
project && pip install -r requirements.txt``. Checked here, each refusal one line:

* torch is the job's (``--torch-version``): a line (or a nested ``-r``/``-c`` file, or a torch wheel)
  that asks for another torch is refused. ``torch`` alone, or a range that holds the job's, is
  kept (the node's torch satisfies it).
* ``-e`` (editable) is refused: the node's copy of the project is not a place to develop in.
* a path (a package directory, a wheel or archive, ``-r``/``-c`` files, ``--find-links`` dirs)
  must be inside the project and exist; a requirements file outside a project may name none.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from petctl.errors import ConfigError

#: The file a project directory's top may hold.
DEFAULT_FILE = "requirements.txt"
#: Options whose value is a nested requirements/constraints file.
_NESTED = {
    "-r": "requirements",
    "--requirement": "requirements",
    "-c": "constraints",
    "--constraint": "constraints",
}
_EDITABLE = ("-e", "--editable")
_FIND_LINKS = ("-f", "--find-links")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)
_ARCHIVE = (".whl", ".tar.gz", ".tgz", ".zip", ".tar.bz2")


@dataclass
class Requirements:
    """What every node installs: the file's text, where it lies in the project (if it does), its
    requirement lines (for ``--dry-run``), and whether it names files of the project."""

    text: str = ""
    source: str = ""
    #: the file's path inside the project ("" when outside it)
    project_path: str = ""
    lines: list[str] = field(default_factory=list)
    local_files: bool = False

    def __bool__(self) -> bool:
        return bool(self.text.strip())

    def digest(self, project_data: bytes | None) -> str:
        """The requirements' hash, with the project's when they name its files (a changed wheel in
        it is another environment)."""
        h = hashlib.sha256(self.text.encode())
        if self.local_files and project_data is not None:
            h.update(hashlib.sha256(project_data).digest())
        return h.hexdigest()


def find(target: str, given: str | None, skip: bool) -> Requirements:
    """The request's requirements: ``--requirements FILE``, else the project's top
    ``requirements.txt``, else none (and none with ``--no-requirements``)."""
    if skip:
        return Requirements()
    project = Path(target) if not target.startswith("s3://") and Path(target).is_dir() else None
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise ConfigError(f"--requirements {given}: no such file")
    elif project is not None and (project / DEFAULT_FILE).is_file():
        path = project / DEFAULT_FILE
    else:
        return Requirements()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the requirements {path}: {e}") from None
    rel = ""
    if project is not None:
        try:
            rel = path.resolve().relative_to(project.resolve()).as_posix()
        except ValueError:
            rel = ""
    return Requirements(text=text, source=str(path), project_path=rel)


def check(reqs: Requirements, torch_version: str, project: Path | None) -> Requirements:
    """Check ``reqs`` against the job's torch and the project (see the module doc); fills its
    ``lines`` and ``local_files``. Raises ConfigError, one line, on the first refusal."""
    if not reqs:
        return reqs
    root = project.resolve() if project is not None and reqs.project_path else None
    base = (root / reqs.project_path).parent if root is not None else None
    _check_file(reqs, reqs.text, reqs.source, base, root, torch_version, set())
    return reqs


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) with comments dropped and ``\\`` continuations joined, as pip reads them."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if not buf:
            start = n
        line = re.sub(r"(^|\s)#.*$", "", raw)
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line = (buf + line).strip()
        buf = ""
        if line:
            out.append((start, line))
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _check_file(
    reqs: Requirements,
    text: str,
    where: str,
    base: Path | None,
    root: Path | None,
    torch_version: str,
    seen: set[Path],
    nested: bool = False,
) -> None:
    for n, line in _logical_lines(text):
        at = f"{where} line {n}"
        if line.startswith("-"):
            opt, value = _option(line)
            if opt in _EDITABLE:
                raise ConfigError(f"{at}: {line!r}: editable installs (-e) are not supported on the nodes; "
                                  f"name the package's directory without -e")  # fmt: skip
            if opt in _NESTED:
                path = _local(value, base, root, at, line)
                reqs.local_files = True
                if path in seen:
                    continue
                seen.add(path)
                _check_file(reqs, path.read_text(), str(path), path.parent, root, torch_version, seen, True)
            elif opt in _FIND_LINKS and not _URL.match(value):
                _local(value, base, root, at, line)
                reqs.local_files = True
            continue
        spec = line.split(" --", 1)[0].strip()  # per-requirement options (--hash=...)
        if not nested:
            reqs.lines.append(spec)
        _check_requirement(reqs, spec, at, base, root, torch_version)


def _option(line: str) -> tuple[str, str]:
    """``-r file``, ``-rfile``, ``--requirement file``, ``--requirement=file`` -> (option, value)."""
    head, _, rest = line.partition(" ")
    if head.startswith("--") and "=" in head:
        head, _, first = head.partition("=")
        rest = (first + " " + rest).strip()
    elif not head.startswith("--") and len(head) > 2:
        head, rest = head[:2], (head[2:] + " " + rest).strip()
    return head, rest.strip()


def _local(value: str, base: Path | None, root: Path | None, at: str, line: str) -> Path:
    """A path a requirements line names (pip looks beside the file, then in the project's top):
    inside the project, and there."""
    if root is None or base is None:
        raise ConfigError(f"{at}: {line!r} names a file, which a requirements file outside the project "
                          f"cannot: put the file in the project, or name packages only")  # fmt: skip
    value = shlex.split(value)[0] if value.strip() else ""
    value = re.sub(r"^file:(//)?", "", value)
    if not value or Path(value).is_absolute():
        raise ConfigError(f"{at}: {line!r}: name files by a path relative to the project")
    outside = False
    for candidate in ((base / value).resolve(), (root / value).resolve()):
        if candidate != root and root not in candidate.parents:
            outside = True
        elif candidate.exists():
            return candidate
    if outside:
        raise ConfigError(f"{at}: {line!r} names {value}, outside the project: every node has only the "
                          f"project's files")  # fmt: skip
    raise ConfigError(f"{at}: {line!r}: {value} is not in the project")


def _check_requirement(
    reqs: Requirements, spec: str, at: str, base: Path | None, root: Path | None, torch_version: str
) -> None:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        r = Requirement(spec)
    except InvalidRequirement:
        r = None
    if r is None or (r.url and r.url.startswith("file:")):
        # a path or a URL: a package directory, a wheel, an archive
        target = r.url if r is not None else spec
        if _URL.match(target) and not target.startswith("file:"):
            _refuse_torch_file(target.rsplit("/", 1)[-1], at, spec, torch_version)
            return
        path = _local(target, base, root, at, spec)
        reqs.local_files = True
        _refuse_torch_file(path.name, at, spec, torch_version)
        return
    if re.sub(r"[-_.]+", "-", r.name).lower() != "torch":
        return
    if r.url:
        raise ConfigError(f"{at}: {spec!r} asks for a torch from {r.url}; the job runs torch {torch_version} "
                          f"(--torch-version) on every node: remove the line")  # fmt: skip
    if r.specifier and not r.specifier.contains(torch_version, prereleases=True):
        raise ConfigError(f"{at}: {spec!r} asks for another torch than the job's torch {torch_version} "
                          f"(--torch-version): every node runs that one; remove the line or make it match")  # fmt: skip


def _refuse_torch_file(name: str, at: str, spec: str, torch_version: str) -> None:
    """A torch wheel or archive by file name (``torch-2.1.0-...whl``) of another version."""
    m = re.match(r"^torch-([0-9][^-]*?)(?:-|\.tar\.gz$|\.zip$)", name)
    if m and m.group(1).split("+")[0] != torch_version:
        raise ConfigError(f"{at}: {spec!r} is torch {m.group(1)}, not the job's torch {torch_version} "
                          f"(--torch-version): remove the line")  # fmt: skip


def lines_for_plan(reqs: Requirements, torch_version: str) -> dict[str, object]:
    """What ``--dry-run`` shows each node will install."""
    return {
        "file": reqs.source,
        "requirements": list(reqs.lines),
        "constraints": f"torch=={torch_version} and petctl's own dependencies, as installed on the node",
    }
