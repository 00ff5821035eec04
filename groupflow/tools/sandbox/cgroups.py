"""Bounds for a sandbox as a whole: a control group per run, where this process may make one.

Design decision: rlimits bind one process each (16 processes × ``memory_mb`` is 16 × the limit)
and count nothing that is not mapped (a memfd, a tmpfs file); a memory cgroup counts every page
the sandbox's processes own or cache — anonymous memory, tmpfs and memfd pages alike — and a pids
cgroup every process and thread. So each run gets a cgroup of its own under a parent found once
per process, which the sandbox's first process joins (through a descriptor of the cgroup's
``cgroup.procs`` opened here and handed in, so nothing inside needs write access to the cgroup
filesystem) before any model code runs; everything it starts inherits it. The parent is, in
order:

- ``GROUPFLOW_SANDBOX_CGROUP`` (or the bwrap backend's ``cgroup`` option): a cgroup v2 directory
  delegated to this user whose children may have the memory and pids controllers (``none``: use
  no cgroup);
- cgroup v2: this process's own cgroup when it already hands memory and pids to its children
  (the root cgroup, or one prepared so: a cgroup with processes cannot, by v2's rules);
- cgroup v1: this process's own cgroups in the memory and the pids hierarchies, where writable
  (root on a v1 or hybrid host; either one alone bounds what it bounds).

Where none is found the sandbox keeps its per-process limits and says so once (the README lists
what each case guarantees). A run's cgroup is removed when the run ends; the cgroups of a crashed
trainer (named after its pid) are removed by the next one.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass

__all__ = ["CGROUP_ENV", "CgroupPlace", "RunCgroup", "find_cgroup"]

log = logging.getLogger(__name__)

CGROUP_ENV = "GROUPFLOW_SANDBOX_CGROUP"
CONTROLLERS = ("memory", "pids")
_PREFIX = "groupflow-sandbox-"
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupPlace:
    """Where run cgroups are made: ``dirs`` maps a controller to the directory its run cgroups
    go in (cgroup v2: one directory for both)."""

    version: int
    dirs: tuple[tuple[str, str], ...]

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(c for c, _ in self.dirs)

    def describe(self) -> str:
        places = ", ".join(f"{c} in {d}" for c, d in self.dirs)
        return f"cgroup v{self.version}: {places}"


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of every cgroup mount this process sees."""
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), set(tail[2].split(","))))
    return out


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _own_cgroups() -> dict[str, str]:
    """controller ('' for cgroup v2) -> this process's cgroup path."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _under(mount_root: str, mount_point: str, path: str) -> str | None:
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/") and root:
        return None
    return os.path.join(mount_point, path[len(root) :].lstrip("/"))


def _writable(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _v2_ready(path: str) -> str | None:
    """None if run cgroups with memory and pids can be made in ``path``, else why not."""
    if not os.path.isfile(os.path.join(path, "cgroup.controllers")):
        return f"{path} is not a cgroup v2 directory"
    if not _writable(path):
        return f"{path} is not writable by this user"
    enabled = set(_read(os.path.join(path, "cgroup.subtree_control")).split())
    missing = [c for c in CONTROLLERS if c not in enabled]
    if missing:
        try:  # a delegated, empty cgroup may enable them itself
            with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in missing))
        except OSError as exc:
            return f"{path} does not give its children {missing} ({exc.strerror})"
    return None


@functools.cache
def find_cgroup(explicit: str | None = None) -> tuple[CgroupPlace | None, str]:
    """The place for run cgroups (see the module docstring) and, when there is none, why."""
    choice = explicit if explicit is not None else os.environ.get(CGROUP_ENV)
    if choice == "none":
        return None, f"{CGROUP_ENV}=none"
    try:
        if choice:
            problem = _v2_ready(choice)
            if problem is not None:
                raise ValueError(f"{CGROUP_ENV}={choice!r}: {problem}")
            return _cleaned(CgroupPlace(2, (("memory", choice), ("pids", choice)))), ""
        mounts, own = _mounts(), _own_cgroups()
    except OSError as exc:
        return None, f"cannot read this process's cgroups ({exc})"
    reasons: list[str] = []
    place = _v2_place(mounts, own, reasons) or _v1_place(mounts, own, reasons)
    if place is not None:
        return _cleaned(place), "; ".join(reasons) if place.version == 1 else ""
    return None, "; ".join(reasons) or "no cgroup file system is mounted"


def _v2_place(mounts, own: dict[str, str], reasons: list[str]) -> CgroupPlace | None:
    """This process's cgroup v2 directory when run cgroups can be made there (else a reason)."""
    for fstype, root, point, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            path = _under(root, point, own[""])
            if path is None:
                continue
            problem = _v2_ready(path)
            if problem is None:
                return CgroupPlace(2, (("memory", path), ("pids", path)))
            reasons.append(f"cgroup v2: {problem}")
    return None


def _v1_place(mounts, own: dict[str, str], reasons: list[str]) -> CgroupPlace | None:
    """A writable cgroup v1 directory per controller this process has one for (a reason for
    each that is missing); None when there is none at all."""
    dirs = []
    for controller in CONTROLLERS:
        for fstype, root, point, options in mounts:
            if fstype != "cgroup" or controller not in options or controller not in own:
                continue
            path = _under(root, point, own[controller])
            if path is not None and _writable(path):
                dirs.append((controller, path))
                break
        else:
            reasons.append(f"cgroup v1: no writable {controller} cgroup")
    return CgroupPlace(1, tuple(dirs)) if dirs else None


def _cleaned(place: CgroupPlace) -> CgroupPlace:
    """``place``, after removing run cgroups left by trainers that are gone."""
    for _, path in place.dirs:
        try:
            names = os.listdir(path)
        except OSError:
            continue
        for name in names:
            m = re.fullmatch(rf"{_PREFIX}(\d+)-\d+", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                try:
                    os.rmdir(os.path.join(path, name))
                except OSError:
                    pass
    return place


class RunCgroup:
    """One run's cgroup(s): limits written, ``cgroup.procs`` descriptors open for the sandbox's
    first process to join, removed by :meth:`close`."""

    def __init__(self, place: CgroupPlace, memory_bytes: int, processes: int) -> None:
        self.place = place
        self.paths: dict[str, str] = {}
        self.fds: list[int] = []
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            for controller, parent in place.dirs:
                path = os.path.join(parent, name)
                if path not in self.paths.values():
                    os.mkdir(path)
                self.paths[controller] = path
            if "memory" in self.paths:
                self._memory(self.paths["memory"], memory_bytes)
            if "pids" in self.paths:
                _write(self.paths["pids"], "pids.max", str(processes))
            for path in dict.fromkeys(self.paths.values()):
                self.fds.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY))
        except OSError:
            self.close()
            raise

    def _memory(self, path: str, limit: int) -> None:
        if self.place.version == 2:
            _write(path, "memory.max", str(limit))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(path, "memory.swap.max", "0")
            return
        _write(path, "memory.limit_in_bytes", str(limit))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            _write(path, "memory.memsw.limit_in_bytes", str(limit))  # no swap beyond it

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the memory limit."""
        path = self.paths.get("memory")
        if path is None:
            return False
        name = "memory.events" if self.place.version == 2 else "memory.oom_control"
        try:
            text = _read(os.path.join(path, name))
        except OSError:
            return False
        m = re.search(r"^oom_kill (\d+)", text, re.MULTILINE)
        return bool(m and int(m.group(1)))

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        for path in reversed(list(dict.fromkeys(self.paths.values()))):
            _remove(path)
        self.paths = {}


def _write(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(value)


def _remove(path: str) -> None:
    """rmdir, retried for a moment: the run's last processes may still be exiting."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                log.debug("sandbox cgroup %s not removed: %s", path, exc)
                return
            time.sleep(0.01)
