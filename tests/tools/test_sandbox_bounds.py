"""The sandbox's limits bound the sandbox as a whole, not one process each (issue 31, items 3-4):
memory held in memfds and by many processes, disk written anywhere (a tmpfs of the code's own in
a user namespace, /dev, /dev/shm), processes — for a trainer running as root (this machine's
tests) and, through a subprocess, as an unprivileged user; and nothing inside shows where
groupflow or the run's files live on the host."""

import ctypes  # noqa: F401  (the attacks below use it inside the sandbox)
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import groupflow
from groupflow.tools import run_python
from groupflow.tools.sandbox.bwrap import BwrapSandbox, Setup, bwrap_path, machine_setup
from groupflow.tools.sandbox.cgroups import find_cgroup

MB = 1 << 20


def _backend(**changes) -> BwrapSandbox:
    if bwrap_path() is None:
        pytest.skip("needs bubblewrap")
    import dataclasses

    return BwrapSandbox(bwrap_path(), dataclasses.replace(machine_setup(bwrap_path()), **changes))


def _needs_cgroup(controller: str):
    place, why = find_cgroup()
    if place is None or controller not in place.controllers:
        pytest.skip(f"no writable {controller} cgroup here ({why})")


# Fills memfds of 16 MiB each (RLIMIT_FSIZE's default), printing the MiB held after each.
MEMFDS = """
import os
held, fds = 0, []
try:
    for i in range(20):
        fd = os.memfd_create(f"m{i}")
        for _ in range(16):
            os.write(fd, b"x" * (1 << 20))
            held += 1
        fds.append(fd)
        print(held, flush=True)
except OSError as exc:
    print("refused", exc.errno, flush=True)
"""


def _held(stdout: str) -> int:
    numbers = [int(x) for x in stdout.split() if x.isdigit()]
    return max([0, *[n for n in numbers if n > 1]])


def test_memfds_count_against_the_sandboxs_memory():
    _needs_cgroup("memory")
    result = run_python(MEMFDS, memory_mb=64, max_disk_mb=8, timeout_s=20)
    # the run's cgroup: memory_mb + max_disk_mb + /dev/shm + the supervisor = 89 MiB
    assert _held(result.stdout) <= 89, result.stdout
    assert result.limit == "memory" or "refused" in result.stdout


def test_without_a_memory_cgroup_memfds_are_refused():
    result = run_python(MEMFDS, memory_mb=64, timeout_s=20, sandbox=_backend(cgroup=None))
    assert result.stdout.split() == ["refused", "1"]  # EPERM from the seccomp filter


# Forks 12 children that each take and touch 40 MiB and stay; prints how many are alive at the end.
PROCESSES = """
import os, time
pids = []
for _ in range(12):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        block = bytearray(40 << 20)
        block[::4096] = b"y" * len(block[::4096])
        os.write(w, b"1")
        time.sleep(10)
        os._exit(0)
    os.close(w)
    os.read(r, 1)  # it holds its 40 MiB (or it was killed)
    pids.append(pid)
time.sleep(0.5)
print(sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids), flush=True)
"""


def test_many_processes_share_one_memory_limit():
    _needs_cgroup("memory")
    result = run_python(PROCESSES, memory_mb=128, max_disk_mb=8, timeout_s=20, max_processes=16)
    alive = int(result.stdout.split()[0])
    assert alive * 40 <= 128 + 8 + 1 + 16, result.stdout  # not 12 x 40 = 480 MiB at once


NESTED_NAMESPACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
print("unshare", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), ctypes.get_errno(), flush=True)
os.mkdir("mnt")
print("mount", libc.mount(b"none", b"mnt", b"tmpfs", 0, b"size=512m"), flush=True)
"""


def test_no_user_namespace_of_its_own_so_no_tmpfs_of_its_own():
    result = run_python(NESTED_NAMESPACE, max_disk_mb=8)
    assert result.stdout.split()[:3] == ["unshare", "-1", "1"]  # EPERM
    assert result.stdout.split()[3:5] == ["mount", "-1"]


# Writes up to 90 MiB to each place that might be writable; prints the MiB each took.
FILL = """
def fill(path, mb=90):
    done = 0
    try:
        with open(path, "wb") as f:
            for _ in range(mb):
                f.write(b"x" * (1 << 20))
                f.flush()
                done += 1
    except OSError:
        pass
    return done

import json
print(json.dumps({p: fill(p) for p in ("/dev/big", "/dev/shm/big", "big", "/tmp/big")}))
"""


def test_disk_is_bounded_everywhere_the_code_can_write():
    result = run_python(FILL, max_disk_mb=8, memory_mb=256, timeout_s=20)
    written = json.loads(result.stdout)
    assert written["/dev/big"] == 0 and written["/tmp/big"] == 0
    assert written["/dev/shm/big"] <= 1 and written["big"] <= 8


def test_nothing_inside_shows_where_groupflow_or_the_runs_files_are():
    code = (
        "import os\nprint(open('/proc/1/cmdline').read().replace(chr(0), ' '))\n"
        "print(open('/proc/self/mountinfo').read())\nprint(os.getpid(), os.getppid())"
    )
    result = run_python(code)
    package = str(Path(groupflow.__file__).resolve().parent)
    assert package not in result.stdout and "groupflow-sandbox-" not in result.stdout
    assert "/.groupflow/child.py" in result.stdout  # the supervisor is the namespace's pid 1


# ----- a trainer that is not root ------------------------------------------------------------

NON_ROOT = r"""
import json, sys
sys.path[:0] = SYS_PATH
from groupflow.tools import run_python
fork = '''
import os, time
n = 0
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError as exc:
    print(n, exc.errno)
else:
    print(n, 0)
'''
forks = run_python(fork, max_processes=16, timeout_s=20).stdout.split()
filled = json.loads(run_python(FILL, max_disk_mb=8, memory_mb=256, timeout_s=20).stdout)
print(json.dumps({"forks": forks, "filled": filled}))
"""


def _system_python() -> str | None:
    """A Python readable by any user with this interpreter's version (the venv's may live under
    /root), which can then import groupflow from the checkout and the venv's packages."""
    for candidate in (f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}",):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _non_root_script() -> str:
    import site

    paths = [str(Path(groupflow.__file__).resolve().parents[1]), *site.getsitepackages()]
    return NON_ROOT.replace("SYS_PATH", repr(paths)).replace("FILL", repr(FILL))


def test_a_non_root_trainer_gets_the_process_cap_and_a_bounded_dev():
    """As an unprivileged user (uid 200777, no cgroup it may write): RLIMIT_NPROC, counted in
    bubblewrap's user namespace for the sandbox alone, caps the fork bomb; /dev is read-only."""
    python, setpriv = _system_python(), shutil.which("setpriv")
    if os.geteuid() != 0 or python is None or setpriv is None or bwrap_path() is None:
        pytest.skip("needs root (to become another user), setpriv and a system python")
    done = subprocess.run(
        [setpriv, "--reuid=200777", "--regid=200777", "--clear-groups", python, "-c",
         _non_root_script()],
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    count, errno = map(int, out["forks"])
    assert errno == 11 and count < 16  # EAGAIN
    assert out["filled"]["/dev/big"] == 0 and out["filled"]["/dev/shm/big"] <= 1
    assert out["filled"]["big"] <= 8


def test_root_behind_a_user_namespace_is_warned_that_processes_are_not_capped(tmp_path):
    """`unshare --user --map-user=1000` keeps the host's uid 0, which the kernel exempts from
    RLIMIT_NPROC: only a pids cgroup could cap processes there, and the sandbox says when none
    is writable; /dev stays bounded."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0 or bwrap_path() is None:
        pytest.skip("needs root and unshare")
    script = tmp_path / "behind.py"
    script.write_text("import logging\nlogging.basicConfig()\n" + _non_root_script())
    done = subprocess.run(
        [unshare, "--user", "--map-user=1000", "--map-group=1000", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no user namespaces here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["filled"]["/dev/big"] == 0 and out["filled"]["/dev/shm/big"] <= 1
    place, _ = find_cgroup()
    count = int(out["forks"][0])
    if count >= 16:  # not capped: then it said so
        assert "max_processes does not bind" in done.stderr


def test_the_setup_decides_user_namespace_and_cgroup_once():
    setup = machine_setup(bwrap_path()) if bwrap_path() else pytest.skip("needs bubblewrap")
    assert isinstance(setup, Setup)
    assert setup.user_namespace == (os.geteuid() != 0)


def test_a_cgroup_v2_parent_is_checked_and_gets_each_runs_limits(tmp_path, monkeypatch):
    """GROUPFLOW_SANDBOX_CGROUP names a v2 directory (here a stand-in: a folder with its files);
    a run's cgroup gets memory.max, no swap and pids.max, and is removed after the run."""
    from groupflow.tools.sandbox import cgroups

    assert find_cgroup("none") == (None, "GROUPFLOW_SANDBOX_CGROUP=none")
    with pytest.raises(ValueError, match="GROUPFLOW_SANDBOX_CGROUP=.*is not a cgroup v2 directory"):
        find_cgroup(str(tmp_path / "missing"))
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory pids\n")
    place, _ = find_cgroup(str(tmp_path))
    assert place.version == 2 and place.controllers == ("memory", "pids")
    real_mkdir = os.mkdir

    def mkdir(path, *args):  # a cgroup directory comes with its interface files
        real_mkdir(path, *args)
        for name in ("cgroup.procs", "memory.swap.max"):
            Path(path, name).write_text("")

    monkeypatch.setattr(cgroups.os, "mkdir", mkdir)
    run = cgroups.RunCgroup(place, 89 * MB, 17)
    (path,) = set(run.paths.values())
    assert Path(path, "memory.max").read_text() == str(89 * MB)
    assert Path(path, "memory.swap.max").read_text() == "0"
    assert Path(path, "pids.max").read_text() == "17" and len(run.fds) == 1
    Path(path, "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert run.oom_killed()
    for name in os.listdir(path):  # the kernel's files vanish with the directory
        os.remove(os.path.join(path, name))
    run.close()
    assert not os.path.exists(path)
