import os
import signal
import time
import tracemalloc
from pathlib import Path

import pytest

from groupflow.tools import SandboxLimits, run_python
from groupflow.tools.sandbox import child_environment, resolve_sandbox

# Generous bound on the time a killed run may take past its limit on a loaded 2-core machine.
SLACK_S = 2.0


def run(code, **kwargs):
    kwargs.setdefault("timeout_s", 5.0)
    return run_python(code, **kwargs)


def guarded(code, **kwargs):
    """Run under the opt-in audit-hook guard (not a security boundary)."""
    return run(code, sandbox="guard", **kwargs)


def test_the_default_backend_is_the_os_sandbox():
    assert resolve_sandbox().name == "bwrap"
    assert run("print(1)").backend == "bwrap" and guarded("print(1)").backend == "guard"


def processes_in_group(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:  # fields after "(comm)": state, ppid, pgrp, ...
            found.append(int(entry.name))
    return found


# --------------------------------------------------------------------------------------------
# Normal runs


def test_stdout_stdin_and_status():
    result = run("import sys\nname = sys.stdin.read().strip()\nprint(f'hello {name}')", stdin="ada")
    assert result.stdout == "hello ada\n"
    assert result.stderr == ""
    assert (result.exit_code, result.limit, result.killed, result.ok) == (0, None, False, True)
    assert not result.timed_out and not result.stdout_truncated and not result.stderr_truncated
    assert 0 < result.duration_s < 5 and result.cpu_time_s > 0


def test_no_stdin_means_end_of_file():
    result = run("print(input())")
    assert result.exit_code == 1 and result.error_line == "EOFError: EOF when reading a line"


def test_exception_gives_a_clean_traceback():
    result = run("x = 1\ny = x / 0\n")
    assert result.exit_code == 1 and result.limit is None and not result.killed
    assert result.error_line == "ZeroDivisionError: division by zero"
    # The user's frame with its source line, none of the sandbox's own frames.
    assert 'File "main.py", line 2, in <module>' in result.stderr
    assert "y = x / 0" in result.stderr
    assert "sandbox_child" not in result.stderr


def test_syntax_error_and_exit_status():
    assert run("def f(:\n  pass").error_line == "SyntaxError: invalid syntax"
    assert run("import sys; sys.exit(3)").exit_code == 3
    assert run("raise SystemExit('bye')").stderr == "bye\n"


def test_echo_last_expression_like_a_notebook():
    assert run("x = 6\nx * 7", echo_last_expression=True).stdout == "42\n"
    assert run("x = 6\nx * 7").stdout == ""  # off by default: a plain script
    assert run("print('a')\nNone", echo_last_expression=True).stdout == "a\n"


def test_extra_files_sit_next_to_main():
    result = run("print(open('data.txt').read())", files={"data.txt": "42"})
    assert result.stdout == "42\n"


def test_printed_output_is_reproducible():
    # PYTHONHASHSEED is fixed, so set iteration order (and what the code prints) repeats.
    code = "print(list({'apple', 'banana', 'cherry', 'date', 'elder'}))"
    assert run(code).stdout == run(code).stdout


# --------------------------------------------------------------------------------------------
# Limits


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    started = time.monotonic()
    result = run("while True:\n    pass", timeout_s=0.5, cpu_time_s=60)
    elapsed = time.monotonic() - started
    assert result.limit == "wall_time" and result.timed_out
    assert result.killed and result.exit_code == -signal.SIGKILL
    assert 0.5 <= result.duration_s < 0.5 + SLACK_S and elapsed < 0.5 + SLACK_S


def test_sleeping_code_is_killed_at_the_timeout_too():
    result = run("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=0.5)
    assert result.limit == "wall_time" and result.duration_s < 0.5 + SLACK_S
    assert result.stdout == "started\n"  # what was printed before the kill is kept


def test_cpu_time_limit():
    result = run("while True:\n    pass", timeout_s=30, cpu_time_s=1)
    assert result.limit == "cpu_time" and result.killed
    assert result.exit_code == -signal.SIGXCPU
    assert result.cpu_time_s < 1.0 + SLACK_S


def test_cpu_time_limit_holds_when_sigxcpu_is_ignored():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    result = run(code, timeout_s=30, cpu_time_s=1)
    assert result.limit == "cpu_time" and result.exit_code == -signal.SIGKILL


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(4 * 1024**3)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))"],
    ids=["one-big-allocation", "growing"],
)
def test_memory_hog_is_refused_at_the_limit(code):
    result = run(code, memory_mb=128)
    assert result.limit == "memory" and result.exit_code == 1
    assert result.error_line.startswith("MemoryError")
    assert result.duration_s < 5


def test_memory_limit_leaves_room_below_it():
    result = run("x = bytearray(64 * 1024**2)\nprint(len(x))", memory_mb=256)
    assert result.ok and result.stdout == f"{64 * 1024**2}\n"


def test_output_flood_is_cut_and_the_child_killed():
    result = run("while True:\n    print('x' * 1000)", max_output_bytes=10_000)
    assert result.limit == "output" and result.stdout_truncated and not result.stderr_truncated
    assert result.killed and result.exit_code == -signal.SIGKILL
    assert len(result.stdout) == 10_000 and set(result.stdout) <= {"x", "\n"}
    assert result.duration_s < 5


def test_stderr_flood_is_cut_too():
    result = run("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)", max_output_bytes=5000)
    assert result.limit == "output" and result.stderr_truncated and len(result.stderr) == 5000


def test_flood_costs_the_driver_bounded_memory():
    # The child tries to write 200 MB at once; the parent reads at most the cap (+1 byte).
    cap = 100_000
    tracemalloc.start()
    try:
        result = run("import sys\nsys.stdout.write('x' * 200_000_000)", max_output_bytes=cap)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.limit == "output" and len(result.stdout) == cap
    assert peak < 10 * cap


def test_file_size_limit():
    result = run("open('big', 'wb').write(b'x' * (2 * 1024**2))", max_file_mb=1)
    assert result.limit == "file_size" and "File too large" in result.error_line


def test_limits_are_set_in_the_child():
    code = (
        "import resource as r\n"
        "for name in ('CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE', 'NPROC'):\n"
        "    print(name, *r.getrlimit(getattr(r, 'RLIMIT_' + name)))"
    )
    result = run(code, timeout_s=3, memory_mb=256, max_file_mb=2, max_open_files=32)
    limits = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    nproc = "16 16" if os.geteuid() == 0 else "unlimited"  # the sandbox's own user, when root
    limits["NPROC"] = nproc if limits["NPROC"] == nproc else limits["NPROC"]
    assert limits == {
        "CPU": "3 4",  # soft = the CPU seconds (defaults to the timeout), hard one more
        "AS": f"{256 * 2**20} {256 * 2**20}",
        "FSIZE": f"{2 * 2**20} {2 * 2**20}",
        "NOFILE": "32 32",
        "CORE": "0 0",
        "NPROC": nproc,
    }
    guard = guarded(code, timeout_s=3).stdout.splitlines()
    assert "NPROC 0 0" in guard  # binds non-root users only: the guard's hook holds for root


def test_the_code_cannot_raise_its_limits():
    code = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"
    # The OS sandbox's user has no capability left, so the kernel refuses.
    assert run(code).error_line == "ValueError: not allowed to raise maximum limit"
    result = guarded(code)
    assert result.limit == "guard"
    assert result.error_line.startswith("PermissionError: sandbox: resource.setrlimit")


# --------------------------------------------------------------------------------------------
# Processes: capped by RLIMIT_NPROC for the OS sandbox's own user, refused by the guard


FORK_BOMB = "import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()"


def test_fork_bomb_is_refused_by_the_guard_and_leaves_no_process():
    result = guarded(FORK_BOMB, timeout_s=2)
    assert result.limit == "guard" and result.exit_code == 1
    assert result.error_line == (
        "PermissionError: sandbox: os.fork is not allowed (model code may not start processes)"
    )
    pid = int(result.stdout.split()[0])
    assert processes_in_group(pid) == []  # the child ran in its own group; nothing of it is left


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\nos.popen('true')",
        "import os\nos.execv('/bin/true', ['true'])",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
        "import os\nos.spawnl(os.P_WAIT, '/bin/true', 'true')",
        "import pty\npty.fork()",
        "import multiprocessing as mp\np = mp.Process(target=print)\np.start()",
        # the private function subprocess forks with raises no audit event of its own
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
        # undoing that patch by loading a fresh module is refused as well
        "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
        "import sys\ndel sys.modules['posix']\nimport posix",
    ],
    ids=[
        "subprocess",
        "system",
        "popen",
        "exec",
        "posix_spawn",
        "spawn",
        "pty",
        "multiprocessing",
        "fork_exec",
        "reimport-fork_exec",
        "reimport-posix",
    ],
)
def test_every_way_to_start_a_process_is_refused_by_the_guard(code):
    result = guarded(code)
    assert result.limit == "guard", result.stderr
    assert result.error_line.startswith("PermissionError: sandbox: ")


def test_signals_only_to_itself_under_the_guard():
    result = guarded("import os\nos.kill(os.getppid(), 0)")
    assert result.limit == "guard" and "os.kill" in result.error_line
    assert guarded("import os, signal\nos.kill(os.getpid(), 0)\nprint('ok')").stdout == "ok\n"


def test_native_calls_are_unavailable_under_the_guard():
    result = guarded("import ctypes")
    assert result.limit == "guard"
    assert result.error_line.startswith("ImportError: sandbox: ctypes is not available")


def test_no_network_under_the_guard():
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)"
    result = guarded(code)
    assert result.limit == "guard" and "model code has no network" in result.error_line
    # Local socket pairs (asyncio's event loop needs one) still work, in both backends.
    code = "import asyncio\nasyncio.run(asyncio.sleep(0))\nprint('ok')"
    assert guarded(code).stdout == run(code).stdout == "ok\n"


# --------------------------------------------------------------------------------------------
# Environment, working directory, files


@pytest.mark.parametrize("backend", ["bwrap", "guard"])
def test_environment_is_built_from_scratch(monkeypatch, backend):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-real-key")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    code = "import os\nprint(sorted(os.environ))\nprint(os.environ.get('OPENAI_API_KEY'))"
    result = run(code, sandbox=backend)
    names, key = result.stdout.splitlines()
    expected = set(child_environment("/x")) | ({"PWD"} if backend == "bwrap" else set())
    assert names == str(sorted(expected))  # bubblewrap adds PWD for its --chdir
    assert key == "None"
    code = "import os\nprint(open('/proc/self/environ').read())"
    assert "sk-test" not in run(code, sandbox=backend).stdout


def test_parent_environment_is_unreadable_through_proc(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-real-key")
    code = f"print(open('/proc/{os.getpid()}/environ').read())"
    result = run(code)  # the trainer is not in the sandbox's PID namespace
    assert result.error_line.startswith("FileNotFoundError") and "sk-test" not in result.stdout
    result = guarded(code)
    assert result.limit == "guard" and "sk-test" not in result.stdout
    assert result.error_line.startswith(f"PermissionError: sandbox: reading '/proc/{os.getpid()}")


def test_working_directory_is_fresh_and_private():
    code = "import os\nprint(sorted(os.listdir('.')))\nopen('out.txt', 'w').write('x')"
    assert run(code).stdout == run(code).stdout == "['main.py']\n"
    home = run(
        "import os, tempfile\nprint(os.environ['HOME'] == tempfile.gettempdir() == os.getcwd())"
    )
    assert home.stdout == "True\n"


def test_the_guards_working_directory_is_removed():
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('out.txt', 'w')"
    first, second = guarded(code), guarded(code)
    cwd_1, listing = first.stdout.splitlines()
    cwd_2 = second.stdout.splitlines()[0]
    assert cwd_1 != cwd_2
    assert listing == "['main.py']"  # nothing of an earlier run, nothing of the parent's
    assert not os.path.exists(cwd_1) and not os.path.exists(cwd_2)


@pytest.mark.parametrize("backend", ["bwrap", "guard"])
def test_writing_inside_the_working_directory_works(backend):
    code = (
        "import os, shutil, tempfile\n"
        "os.mkdir('d')\n"
        "open('d/a.txt', 'w').write('a')\n"
        "os.rename('d/a.txt', 'd/b.txt')\n"
        "with tempfile.TemporaryDirectory() as t:\n"
        "    open(os.path.join(t, 'f'), 'w').write('x')\n"
        "shutil.rmtree('d')\n"
        "print(os.listdir('.'))"
    )
    assert run(code, sandbox=backend).stdout == "['main.py']\n"


@pytest.mark.parametrize(
    "action",
    [
        "open({outside!r}, 'w').write('x')",
        "open({outside!r}, 'a').write('x')",
        "import os\nos.open({outside!r}, os.O_WRONLY | os.O_CREAT)",
        "import os\nos.remove({existing!r})",
        "import os\nos.rename({existing!r}, 'moved')",
        "import os\nos.chmod({existing!r}, 0o777)",
        "import os\nos.truncate({existing!r}, 0)",
        "import shutil\nshutil.rmtree({folder!r})",
        "open('../escape.txt', 'w')",
        "import os\nos.symlink({existing!r}, 'link')",
        "import os\nos.link({existing!r}, 'link')",
        "import os\nos.chdir({folder!r})",
        "import os\nos.mknod('device')",
        "import os\nos.mkfifo({outside!r})",
        # The audit event of os.open names the file but not the folder dir_fd points to, so
        # neither a descriptor of an outside folder nor a deeper current directory is allowed.
        "import os\nfd = os.open({folder!r}, os.O_RDONLY)\nos.open('new.txt', os.O_CREAT, dir_fd=fd)",
        "import os\nos.mkdir('a')\nos.chdir('a')\nopen('../../new.txt', 'w')",
    ],
)
@pytest.mark.parametrize("backend", ["bwrap", "guard"])
def test_writes_outside_the_working_directory_are_refused(tmp_path, action, backend):
    existing = tmp_path / "keep.txt"
    existing.write_text("precious")
    outside = tmp_path / "new.txt"
    code = action.format(outside=str(outside), existing=str(existing), folder=str(tmp_path))
    tmp_path.chmod(0o755)  # readable by the OS sandbox's own user too
    result = run(code, readable_paths=(str(tmp_path),), sandbox=backend)  # readable, not writable
    # The guard refuses each action; in the OS sandbox the folder is a read-only mount, and
    # what the code may still do (a symlink, a plain file from mknod) stays in its tmpfs.
    assert backend == "bwrap" or result.limit == "guard", result.stderr
    assert existing.read_text() == "precious" and not outside.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("backend", ["bwrap", "guard"])
def test_reads_outside_the_allowed_folders_are_refused(tmp_path, backend):
    secret = tmp_path / ".env"
    secret.write_text("OPENAI_API_KEY=sk-test")
    code = f"print(open({str(secret)!r}).read())"
    result = run(code, sandbox=backend)
    assert result.exit_code == 1 and "sk-test" not in result.stdout
    assert result.limit == ("guard" if backend == "guard" else None)
    tmp_path.chmod(0o755)  # the OS sandbox's own user reads with "other" permissions
    allowed = run(code, readable_paths=(str(tmp_path),), sandbox=backend)
    assert allowed.stdout == "OPENAI_API_KEY=sk-test\n"
    # The standard library and installed packages stay importable.
    code = "import json, decimal, numpy\nprint(numpy.arange(3).sum())"
    assert run(code, sandbox=backend).stdout == "3\n"


# --------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"timeout_s": float("inf")}, "timeout_s must be a positive number"),
        ({"cpu_time_s": -1}, "cpu_time_s must be a positive number"),
        ({"memory_mb": 8}, "memory_mb must be an integer >= 32"),
        ({"memory_mb": 256.0}, "memory_mb must be an integer >= 32"),
        ({"max_output_bytes": 0}, "max_output_bytes must be an integer >= 1"),
        ({"max_file_mb": -1}, "max_file_mb must be an integer >= 0"),
        ({"max_open_files": True}, "max_open_files must be an integer >= 16"),
        ({"max_disk_mb": 0}, "max_disk_mb must be an integer >= 1"),
        ({"max_processes": 0}, "max_processes must be an integer >= 1"),
        ({"sandbox": "docker"}, r"sandbox backend must be one of \['auto', 'bwrap', 'remote'"),
        ({"sandbox": {"backend": "remote"}}, "sandbox backend 'remote' needs a 'url'"),
        ({"sandbox": {"backend": "guard", "x": 1}}, "sandbox backend 'guard' takes no options"),
        ({"sandbox": 5}, "sandbox must be one of"),
        ({"readable_paths": ("/no/such/path",)}, "readable_paths: '/no/such/path' does not"),
        ({"stdin": 5}, "stdin must be str or bytes"),
        ({"files": {"../x": "a"}}, "'../x' is not a plain file name"),
        ({"files": {"main.py": "a"}}, "'main.py' is not a plain file name"),
        ({"readable_paths": "/etc"}, "readable_paths must be a list of paths"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_python("print(1)", **kwargs)


def test_code_must_be_a_string():
    with pytest.raises(ValueError, match="code must be a string, got bytes"):
        run_python(b"print(1)")


def test_limits_object_round_trips_to_run_python():
    limits = SandboxLimits(timeout_s=2, memory_mb=128)
    assert limits.cpu_seconds == 2
    assert SandboxLimits(timeout_s=0.3).cpu_seconds == 1
    assert run_python("print(1)", **limits.as_kwargs()).stdout == "1\n"
