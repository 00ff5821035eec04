"""The first code that runs inside a sandbox subprocess: limits, then user code.

Design decision: everything that must hold before model-written code runs happens here, in the
child, in a fixed order. Two modes, one per local backend:

- ``isolated`` (bubblewrap): this script is the first process of the new PID namespace — as
  root with only CAP_SETUID/CAP_SETGID when the trainer is root, else as the trainer's user in
  bubblewrap's user namespace. It joins the run's cgroups (descriptors of their ``cgroup.procs``,
  opened by the trainer) and forks; the child closes every descriptor but its standard streams,
  offers itself first to the OOM killer, drops to the sandbox's own unprivileged user when there
  is one (no capabilities left, so RLIMIT_NPROC binds), sets the resource limits and runs
  ``main.py``. The parent stays behind as a supervisor the code cannot signal (the namespace's
  first process ignores signals from inside it): it reaps every orphan and writes the code's
  exit status and CPU time to a pipe the code never holds, since bubblewrap reports neither
  faithfully.
- ``guard`` (opt-in, not a security boundary): resource limits, then an audit hook (PEP 578) that
  refuses what rlimits cannot stop for root (new processes, network, writes outside the working
  directory, reads outside an allow-list, raising the limits again). It stops accidents only:
  native code and introspection bypass it.

Applying limits here rather than in a ``preexec_fn`` keeps the parent's spawn fork-safe (no
Python runs between fork and exec in the trainer process). The file is run as a script and
imports only the standard library; it is not part of the groupflow import graph.
"""

from __future__ import annotations

import _thread
import builtins
import io
import json
import os
import resource
import sys
import types

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

# Events refused outright, with the reason the model sees.
_NO_PROCESSES = "model code may not start processes"
_NO_NETWORK = "model code has no network"
_REFUSED = {
    "os.fork": _NO_PROCESSES,
    "os.forkpty": _NO_PROCESSES,
    "os.system": _NO_PROCESSES,
    "os.exec": _NO_PROCESSES,
    "os.posix_spawn": _NO_PROCESSES,
    "os.spawn": _NO_PROCESSES,
    "subprocess.Popen": _NO_PROCESSES,
    "os.link": "hard links could alias files outside the working directory",
    "os.symlink": "symbolic links could point outside the working directory",
    "resource.setrlimit": "the sandbox's resource limits are fixed",
    "resource.prlimit": "the sandbox's resource limits are fixed",
    "socket.connect": _NO_NETWORK,
    "socket.bind": _NO_NETWORK,
    "socket.sendto": _NO_NETWORK,
    "socket.sendmsg": _NO_NETWORK,
    "socket.getaddrinfo": _NO_NETWORK,
    "socket.gethostbyname": _NO_NETWORK,
    "socket.gethostbyaddr": _NO_NETWORK,
    "socket.getnameinfo": _NO_NETWORK,
    "ctypes.dlsym": "native calls would bypass the sandbox",
    "ctypes.call_function": "native calls would bypass the sandbox",
}
# Events whose path arguments (by position) must lie inside the working directory.
_WRITE_EVENTS = {
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.rmdir": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "os.chflags": (0,),
    "os.lchflags": (0,),
    "shutil.rmtree": (0,),
}
# Modules whose functions are patched below; loading a fresh copy would undo the patch.
_NO_REIMPORT = frozenset({"posix", "os", "_posixsubprocess"})


def _refuse(what: str, why: str) -> PermissionError:
    # A plain PermissionError reads naturally in the model's traceback; the "sandbox:" prefix is
    # how the parent tells a refusal from the code's own permission errors.
    return PermissionError(f"sandbox: {what} is not allowed ({why})")


def apply_limits(config: dict) -> None:
    """``setrlimit`` for CPU seconds, address space, file size, open files, core dumps, processes.

    The hard CPU limit is one second above the soft one: the soft limit sends SIGXCPU (which
    ends Python), the hard one SIGKILL if the code ignores SIGXCPU. RLIMIT_NPROC counts the
    processes and threads of the code's user; root is exempt, which is why the isolated mode
    drops to a user of its own and the guard mode refuses new processes in its audit hook.
    """
    cpu = int(config["cpu_time_s"])
    memory = int(config["memory_bytes"])
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_FSIZE, (int(config["file_bytes"]),) * 2),
        (resource.RLIMIT_NOFILE, (int(config["open_files"]),) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if hasattr(resource, "RLIMIT_NPROC") and config.get("processes") is not None:
        processes = int(config["processes"])
        limits.append((resource.RLIMIT_NPROC, (processes, processes)))
    for which, value in limits:
        resource.setrlimit(which, value)


def _replace_unaudited_functions() -> None:
    """``_posixsubprocess.fork_exec``, ``os.mknod`` and ``os.mkfifo`` raise no audit event;
    replace them with functions that refuse.

    ``fork_exec`` is what ``subprocess`` and ``multiprocessing`` fork with (Popen raises an event,
    the private function does not); ``mknod`` as root makes device files, whose writes would reach
    raw disks from inside the working directory; ``mkfifo`` could create files anywhere.
    Re-importing these modules, which would restore the originals, is refused by the hook.
    """
    import _posixsubprocess
    import posix

    def refusing(name: str, why: str):
        def refuse(*args, **kwargs):
            raise _refuse(name, why)

        return refuse

    _posixsubprocess.fork_exec = refusing("_posixsubprocess.fork_exec", _NO_PROCESSES)
    for name, why in (
        ("mknod", "device files could reach outside the working directory"),
        ("mkfifo", "named pipes are not available"),
    ):
        setattr(posix, name, refusing(f"os.{name}", why))
        setattr(os, name, getattr(posix, name))


def _as_path(value) -> str | None:
    if isinstance(value, int) or value is None:
        return None  # a file descriptor: it was checked when it was opened
    return os.fsdecode(value)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


class Guard:
    """The audit hook: refuses events, checks paths, and stays quiet for everything else.

    ``workdir`` is the only writable tree; ``readable`` are the trees Python may read from (the
    working directory, the interpreter's standard library and site-packages, a few device and
    time-zone files, extra paths the caller allowed). Reading elsewhere is refused so that files
    such as ``/proc/<parent>/environ`` or a repository's ``.env`` stay unreadable.
    """

    def __init__(self, workdir: str, readable: list[str]) -> None:
        self.workdir = os.path.realpath(workdir)
        self.writable = (self.workdir,)
        self.pid = os.getpid()
        own = [workdir, f"/proc/{self.pid}", *readable]
        self.readable = tuple(os.path.realpath(p) for p in own)
        self.armed = False  # set once user code may run: imports of _NO_REIMPORT are refused then
        # Per thread: realpath() inside a check raises events of its own, which are not checked.
        self._state = _thread._local()

    def __call__(self, event: str, args: tuple) -> None:
        if getattr(self._state, "busy", False):
            return
        self._state.busy = True
        try:
            self._check(event, args)
        finally:
            self._state.busy = False

    def _check(self, event: str, args: tuple) -> None:
        if event in _REFUSED:
            raise _refuse(event, _REFUSED[event])
        if event == "open":
            self._check_open(*args[:3])
        elif event in _WRITE_EVENTS:
            for i in _WRITE_EVENTS[event]:
                path = _as_path(args[i]) if i < len(args) else None
                if path is not None:
                    self._check_write(f"{event} on {path!r}", path)
        elif event == "os.chdir":
            # The current directory stays the working directory: relative paths are checked
            # against it, and a deeper one would let "../" in a path given with dir_fd escape.
            path = _as_path(args[0])
            if path is None or os.path.realpath(path) != self.workdir:
                raise _refuse(f"os.chdir to {args[0]!r}", "the working directory is fixed")
        elif event in ("os.kill", "os.killpg"):
            target = args[0]
            own = self.pid if event == "os.kill" else os.getpgid(0)
            if target not in (0, own):
                raise _refuse(f"{event}({target})", "only the sandboxed process itself")
        elif event == "ctypes.dlopen":
            raise ImportError("sandbox: ctypes is not available (native calls bypass the guard)")
        elif event == "import" and self.armed and args[0] in _NO_REIMPORT:
            raise _refuse(f"re-importing {args[0]}", "it would undo the sandbox's patches")

    def _check_write(self, what: str, path: str) -> None:
        if not _inside(path, self.writable):
            raise _refuse(what, "outside the working directory")

    def _check_open(self, value, mode, flags) -> None:
        path = _as_path(value)
        if path is None:
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            (flags or 0) & _WRITE_FLAGS
        )
        if writes:
            self._check_write(f"writing {path!r}", path)
        elif os.path.isdir(path) and not _inside(path, self.writable):
            # A descriptor of an outside folder would let os.open(name, dir_fd=fd) write there:
            # the audit event carries the name but not the folder it is relative to.
            raise _refuse(f"opening the folder {path!r}", "outside the working directory")
        elif not _inside(path, self.readable):
            raise _refuse(f"reading {path!r}", "outside the working directory and Python's files")


def _user_traceback(exc: BaseException) -> None:
    """Print ``exc`` like the interpreter would, without this file's frames."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def run_user_code(filename: str, echo_last_expression: bool) -> None:
    """Run ``filename`` (in the cwd) as ``__main__``; with ``echo_last_expression``, print the
    repr of a final expression statement as a notebook cell would."""
    import ast

    with open(filename, encoding="utf-8") as f:
        source = f.read()
    module = types.ModuleType("__main__")
    module.__file__ = filename
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    try:
        tree = ast.parse(source, filename, "exec")
        last = None
        tail = tree.body[-1] if tree.body else None
        if echo_last_expression and isinstance(tail, ast.Expr):
            tree.body.pop()
            last = ast.Expression(tail.value)
        exec(compile(tree, filename, "exec"), module.__dict__)
        if last is not None:
            value = eval(compile(last, filename, "eval"), module.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:  # the user's error: report it as Python would, exit 1
        _user_traceback(exc)
        sys.exit(1)


def _become_sandbox_user(uid: int) -> None:
    """Drop to ``uid`` (and a group of the same number) with no supplementary groups; changing
    every user id from 0 clears all capabilities."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _supervise(pid: int, status_fd: int) -> None:
    """Reap every process that ends (orphans come to the namespace's first process) until the
    code's own does; write its exit status and CPU time; exit the same way."""
    while True:
        try:
            done, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if done == pid:
            break
    code = os.waitstatus_to_exitcode(status)
    report = {"exit_code": code, "cpu_s": usage.ru_utime + usage.ru_stime}
    os.write(status_fd, json.dumps(report).encode())
    os._exit(code if code >= 0 else 128 - code)


def _join_cgroups(fds: list[int]) -> None:
    """Move this process into the run's cgroups: what it forks after this inherits them."""
    for fd in fds:
        os.write(fd, b"0")
        os.close(fd)


def _first_to_be_killed() -> None:
    """On an out-of-memory kill in the run's cgroup, the code goes before its supervisor."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _line_buffered() -> None:
    """What was printed before a timeout kill still reaches the parent."""
    stdout = sys.stdout
    assert isinstance(stdout, io.TextIOWrapper), "the child's stdout is the parent's pipe"
    stdout.reconfigure(line_buffering=True)


def main() -> None:
    config = json.loads(sys.argv[1])
    # Run like ``python main.py`` in the working directory: its folder first on sys.path, never
    # this file's folder (``-I``/``-P`` would drop it, but they also drop PYTHONHASHSEED).
    sys.path[0] = os.getcwd()
    sys.argv = [config["filename"]]
    if config["mode"] == "isolated":
        status_fd = int(config["status_fd"])
        _join_cgroups([int(fd) for fd in config.get("cgroup_fds") or ()])
        sys.stdout.flush()
        pid = os.fork()
        if pid:
            _supervise(pid, status_fd)
        # nothing but the standard streams: the code must not forge its own status
        os.closerange(3, 1 << 16)
        _first_to_be_killed()
        if config.get("uid") is not None:
            _become_sandbox_user(int(config["uid"]))
        _line_buffered()
        apply_limits(config)
        run_user_code(config["filename"], config["echo_last_expression"])
        return
    _line_buffered()
    apply_limits(config)
    _replace_unaudited_functions()
    guard = Guard(os.getcwd(), config["readable"])
    sys.addaudithook(guard)
    guard.armed = True
    run_user_code(config["filename"], config["echo_last_expression"])


if __name__ == "__main__":
    main()
