"""Every escape an independent review found in the old audit-hook guard, run against the default
(OS) sandbox. Each attack is plain model-writable code plus a check of what it was after: a
secret read, a host file written, a host process signalled, a host port reached, a process that
outlives the run, disk filled. The attack "fails" when its goal is not met, whatever error the
code itself sees."""

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from groupflow.tools import run_python

SECRET = "sk-groupflow-test-secret-4242"


@dataclass
class Host:
    """What an attack aims at, on the host side."""

    folder: Path  # holds .env (the secret) and is where outside writes would land
    victim: subprocess.Popen  # a process of the trainer's user that must survive
    port: int  # a loopback port with a listening host server

    @property
    def env_file(self) -> Path:
        return self.folder / ".env"

    def untouched(self) -> bool:
        return sorted(p.name for p in self.folder.iterdir()) == [".env"]


@pytest.fixture
def host(tmp_path):
    folder = tmp_path / "secrets"
    folder.mkdir()
    (folder / ".env").write_text(f"OPENAI_API_KEY={SECRET}\n")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []

    def accept():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not accepted:
            try:
                accepted.append(server.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield Host(folder, victim, server.getsockname()[1])
    assert not accepted, "a sandboxed program reached a host port"
    victim.kill()
    victim.wait()
    server.close()


def run(code: str, **kwargs):
    kwargs.setdefault("timeout_s", 5.0)
    return run_python(code, **kwargs)


def alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


# Each attack: (id, code with {env}, {folder}, {victim}, {port} placeholders, what must hold).
ATTACKS = [
    (
        # Its parent is the sandbox's supervisor, another user: not permitted.
        "pidfd-kill-parent",
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGTERM)",
        lambda h, r: r.error_line.startswith("PermissionError"),
    ),
    (
        # A host process is not in the sandbox's PID namespace at all.
        "pidfd-kill-host-process",
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({victim}), signal.SIGKILL)",
        lambda h, r: alive(h.victim) and r.exit_code == 1,
    ),
    (
        "kill-victim",
        "import os, signal\nos.kill({victim}, signal.SIGKILL)",
        lambda h, r: alive(h.victim) and r.exit_code == 1,
    ),
    (
        "readline-read-any-file",
        "import readline\nreadline.read_history_file({env!r})\nprint(readline.get_history_item(1))",
        lambda h, r: SECRET not in r.stdout and r.exit_code == 1,
    ),
    (
        "readline-write-any-file",
        "import readline\nreadline.add_history('pwned')\nreadline.write_history_file({new!r})",
        lambda h, r: h.untouched() and r.exit_code == 1,
    ),
    (
        "readline-append-any-file",
        "import readline\nreadline.add_history('pwned')\nreadline.append_history_file(1, {env!r})",
        lambda h, r: (
            h.untouched()
            and SECRET in h.env_file.read_text()
            and "pwned" not in h.env_file.read_text()
        ),
    ),
    (
        "sqlite-outside",
        "import sqlite3\ncon = sqlite3.connect({db!r})\ncon.execute('create table t (x)')\n"
        "con.commit()",
        lambda h, r: h.untouched() and r.exit_code == 1,
    ),
    (
        "listen-without-bind",
        # Serves on 0.0.0.0 in its own network namespace: nobody on the host can connect.
        "import socket, time\ns = socket.socket()\ns.listen()\nprint(s.getsockname()[1])",
        lambda h, r: r.exit_code == 0 and _no_host_listener(int(r.stdout)),
    ),
    (
        "connect-to-host-loopback",
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
        lambda h, r: r.exit_code == 1 and "Error" in r.error_line,
    ),
    (
        # What is visible is only what is bound: the test's folders (and their parents) are not,
        # nor is the trainer's process. (/ holds the parents of the interpreter's and the venv's
        # folders, wherever those live, e.g. /tmp for a checkout there.)
        "list-and-stat-outside",
        "import os\nfor f in (lambda: os.listdir({folder!r}), lambda: os.stat({env!r}),\n"
        "          lambda: list(os.scandir({folder!r})), lambda: os.listdir({parent!r})):\n"
        "    try:\n        print('LEAK', f())\n    except OSError as exc:\n        print(type(exc).__name__)\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))",
        lambda h, r: (
            "LEAK" not in r.stdout
            and r.stdout.count("FileNotFoundError") == 4
            and str(os.getpid()) not in r.stdout.splitlines()[-1]
        ),
    ),
    (
        "cffi-system-shell",
        "import cffi\nffi = cffi.FFI()\nffi.cdef('int system(const char *);')\n"
        "ffi.dlopen(None).system(b'id > f; cat {env} ; echo pwned > {new}')",
        lambda h, r: SECRET not in r.stdout and h.untouched(),
    ),
    (
        "switch-off-the-guard",
        # The old guard sat in a frame's locals; here there is no in-process guard to switch off,
        # and what the trick was for (a host connection, writing outside) still fails.
        "import sys, socket\n"
        "try:\n    sys._getframe(2).f_locals['guard']._check = lambda e, a: None\n"
        "except Exception as exc:\n    print(type(exc).__name__)\n"
        "open({new!r}, 'w').write('pwned')",
        lambda h, r: h.untouched() and r.exit_code == 1,
    ),
    (
        "double-fork-setsid-survivor",
        "import os\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        os.execv('/bin/sleep', ['sleep', '2718.2818'])\n"
        "    os._exit(0)\n"
        "print('parent leaves')",
        lambda h, r: r.exit_code == 0 and _gone("2718.2818"),
    ),
    (
        "fill-the-disk",
        "for i in range(20):\n    open(f'f{{i}}', 'wb').write(b'x' * (16 * 2**20))",
        lambda h, r: r.limit == "disk" and "No space left on device" in r.error_line,
    ),
    (
        "write-system-files",
        "open('/usr/lib/pwned', 'w').write('x')",
        lambda h, r: (
            r.exit_code == 1
            and "Read-only file system" in r.error_line
            and not os.path.exists("/usr/lib/pwned")
        ),
    ),
    (
        "read-parent-environ",
        "import os\nprint(open(f'/proc/{{os.getppid()}}/environ').read())\n"
        "print(open('/proc/1/environ').read())",
        lambda h, r: "OPENAI" not in r.stdout and "GROUPFLOW" not in r.stdout,
    ),
]


def _no_host_listener(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


def _gone(marker: str) -> bool:
    deadline = time.monotonic() + 3
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return host_processes_with(marker) == []


def test_fork_bomb_is_capped_and_leaves_no_process():
    # Each child becomes "sleep 3141.5926" so the test can look for survivors on the host.
    code = (
        "import os\nn = 0\n"
        "try:\n    while True:\n"
        "        if os.fork() == 0:\n            os.execv('/bin/sleep', ['sleep', '3141.5926'])\n"
        "        n += 1\n"
        "except OSError as exc:\n    print(n, exc.errno, flush=True)\n"
    )
    result = run(code, timeout_s=5, max_processes=8)
    count, errno = map(int, result.stdout.split())
    assert errno == 11 and count < 8  # EAGAIN: RLIMIT_NPROC, counted for the sandbox's user
    assert _gone("3141.5926")


@pytest.mark.parametrize(("name", "code", "holds"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_fails_in_the_os_sandbox(host, monkeypatch, name, code, holds):
    monkeypatch.setenv("GROUPFLOW_ATTACK_MARKER", "GROUPFLOW-in-parent-env")
    source = code.format(
        env=str(host.env_file),
        new=str(host.folder / "new"),
        db=str(host.folder / "x.db"),
        folder=str(host.folder),
        parent=str(host.folder.parent.parent),
        victim=host.victim.pid,
        port=host.port,
    )
    result = run(source, max_disk_mb=32)
    assert result.backend == "bwrap"
    assert holds(host, result), (result.stdout, result.stderr)
    assert alive(host.victim) and host.untouched()


def test_the_opt_in_guard_is_not_a_boundary(host):
    """Why the guard is opt-in only: a standard-library module written in C reads past it."""
    code = f"import readline\nreadline.read_history_file({str(host.env_file)!r})\n"
    code += "print(readline.get_history_item(1))"
    assert SECRET in run(code, sandbox="guard").stdout
    assert SECRET not in run(code).stdout
