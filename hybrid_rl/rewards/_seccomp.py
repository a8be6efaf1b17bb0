"""A small seccomp filter for the sandbox (classic BPF, built here: no libseccomp needed).

Why: rlimits bound each process's address space, but some kernel objects hold memory outside it
and outlive the process that made them: ``memfd_create`` and ``memfd_secret`` files, System V shared
memory and message queues, and extended attributes (``setxattr`` and friends: kernel memory per file,
which a size-capped tmpfs does not count). With several processes that adds up to many GB. The filter also closes doors a
test program never needs (namespaces, mounts, ptrace, bpf, keyrings, io_uring, module loading).
Blocked calls fail with EPERM (``clone3`` with ENOSYS, so libc falls back to ``clone``); anything
else is allowed. Only x86_64 and aarch64 are covered; elsewhere ``build_filter`` returns None.
"""

from __future__ import annotations

import platform
import struct

__all__ = ["build_filter"]

_LD_ABS, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
_ALLOW, _KILL = 0x7FFF0000, 0x80000000
_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET

_BLOCKED = (
    "memfd_create memfd_secret shmget msgget setxattr lsetxattr fsetxattr setxattrat unshare setns mount umount2 "
    "pivot_root ptrace bpf perf_event_open userfaultfd keyctl add_key request_key io_uring_setup kexec_load "
    "init_module finit_module open_by_handle_at"
).split()
_ARCHES = {  # machine -> (AUDIT_ARCH_*, syscall numbers)
    "x86_64": (0xC000003E, {
        "memfd_create": 319, "memfd_secret": 447, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190,
        "setxattrat": 463, "shmget": 29, "msgget": 68, "unshare": 272, "setns": 308, "mount": 165,
        "umount2": 166, "pivot_root": 155, "ptrace": 101, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425, "kexec_load": 246,
        "init_module": 175, "finit_module": 313, "open_by_handle_at": 304, "clone": 56, "clone3": 435,
    }),
    "aarch64": (0xC00000B7, {
        "memfd_create": 279, "memfd_secret": 447, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7,
        "setxattrat": 463, "shmget": 194, "msgget": 186, "unshare": 97, "setns": 268, "mount": 40,
        "umount2": 39, "pivot_root": 41, "ptrace": 117, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "keyctl": 219, "add_key": 217, "request_key": 218, "io_uring_setup": 425, "kexec_load": 104,
        "init_module": 105, "finit_module": 273, "open_by_handle_at": 265, "clone": 220, "clone3": 435,
    }),
}  # fmt: skip


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None) -> bytes | None:
    """The compiled filter for this machine's architecture, or None where it is not covered."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, numbers = arch
    program = [_op(_LD_ABS, 4), _op(_JEQ, audit_arch, jt=1), _op(_RET, _KILL), _op(_LD_ABS, 0)]
    if audit_arch == 0xC000003E:  # x32 system calls (bit 30 set) bypass x86_64 numbers: refuse them
        program += [_op(_JSET, 0x40000000, jf=1), _op(_RET, _ERRNO | _ENOSYS)]
    for name in _BLOCKED:
        program += [_op(_JEQ, numbers[name], jf=1), _op(_RET, _ERRNO | _EPERM)]
    program += [_op(_JEQ, numbers["clone3"], jf=1), _op(_RET, _ERRNO | _ENOSYS)]
    # clone(flags, ...): refuse new namespaces; flags are the low 32 bits of args[0] (offset 16, little endian)
    program += [_op(_JEQ, numbers["clone"], jf=3), _op(_LD_ABS, 16), _op(_JSET, _CLONE_NEW_NAMESPACES, jf=1)]
    program += [_op(_RET, _ERRNO | _EPERM), _op(_RET, _ALLOW)]
    return b"".join(program)
