"""A seccomp filter for the bubblewrap sandbox: no new user namespaces, and no memfds where
nothing bounds their memory.

Design decision: a user namespace of its own gives code every capability inside it, enough to
mount a tmpfs that no size cap or rlimit bounds; bubblewrap's ``--disable-userns`` stops that only
when bubblewrap itself runs in a user namespace (not when the trainer is root). So every sandbox
gets this classic-BPF program (``bwrap --seccomp FD``), written out here by hand because it is
seven rules and a library (libseccomp) would be a native dependency for them:

- ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` fail with EPERM; ``clone3``, whose flags sit in
  a struct a filter cannot read, fails with ENOSYS, so the C library falls back to ``clone``
  (threads and processes start as usual);
- optionally ``memfd_create`` fails with EPERM: a memfd's pages count against no tmpfs size and no
  address-space limit once unmapped, only against a memory cgroup, so it is refused where none
  bounds the sandbox;
- a system call of another ABI (i386 or x32 on x86-64), which these numbers do not describe,
  fails with ENOSYS.

Only x86-64 and aarch64 are described; elsewhere :func:`seccomp_program` returns None and the
sandbox runs without the filter (the README says so).
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["seccomp_program"]

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}, little-endian on both machines described.
_LD_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000
# (AUDIT_ARCH, clone, unshare, clone3, memfd_create) per machine
_ABI = {
    "x86_64": (0xC000003E, 56, 272, 435, 319),
    "aarch64": (0xC00000B7, 220, 97, 435, 279),
}
# offsets in struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
_NR, _ARCH, _ARG0_LOW = 0, 4, 16


def _op(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def seccomp_program(deny_memfd: bool, machine: str | None = None) -> bytes | None:
    """The compiled filter for this machine (see the module docstring), or None where the
    machine's system calls are not described here."""
    abi = _ABI.get(machine or platform.machine())
    if abi is None:
        return None
    arch, clone, unshare, clone3, memfd = abi
    no_sys, no_perm = _ERRNO | errno.ENOSYS, _ERRNO | errno.EPERM
    memfd_rule = [_op(_JEQ, 0, 1, memfd), _op(_RET, 0, 0, no_perm)] if deny_memfd else []
    program = [
        _op(_LD_ABS, 0, 0, _ARCH),
        _op(_JEQ, 1, 0, arch),
        _op(_RET, 0, 0, no_sys),  # another ABI
        _op(_LD_ABS, 0, 0, _NR),
        _op(_JGE, 0, 1, _X32_BIT),
        _op(_RET, 0, 0, no_sys),  # x32 numbers on x86-64
        _op(_JEQ, 0, 1, clone3),
        _op(_RET, 0, 0, no_sys),
        *memfd_rule,
        _op(_JEQ, 2, 0, unshare),
        _op(_JEQ, 1, 0, clone),
        _op(_RET, 0, 0, _ALLOW),
        _op(_LD_ABS, 0, 0, _ARG0_LOW),  # the flags of unshare / clone
        _op(_JSET, 0, 1, _CLONE_NEWUSER),
        _op(_RET, 0, 0, no_perm),
        _op(_RET, 0, 0, _ALLOW),
    ]
    return b"".join(program)
