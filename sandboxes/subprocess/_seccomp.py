"""The tool's system-call filter, compiled with libseccomp and handed to bubblewrap.

Namespaces and an unprivileged uid do not stop a tool from reaching kernel surfaces that
are shared with the whole host: the key rings (``add_key``/``keyctl``), ``ptrace`` of its
own sandbox's init (to clear bubblewrap's parent-death signal), ``io_uring``, ``bpf``,
``perf_event_open``, ``userfaultfd``. The filter refuses everything Docker's default
profile refuses and those, and refuses to make set-uid or set-gid files (a tool granted a
workspace must not leave one there for a local user to run). Foreign architectures
(the x32 and i386 entry points of an x86_64 host) kill the process. Without a cgroup it
also refuses the memory that no process's resident size shows (``UNCOUNTED_MEMORY``).

libseccomp (``libseccomp2``, in every Debian) does the compiling; it is bound here with
ctypes through its array-taking entry points, so no variadic call is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
from collections.abc import Callable

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE

# Refused with EPERM: Docker's default profile refuses these too.
DOCKER_DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module",
    "delete_module", "finit_module", "get_kernel_syms", "get_mempolicy", "init_module",
    "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie",
    "mbind", "mount", "mount_setattr", "move_mount", "move_pages", "name_to_handle_at",
    "nfsservctl", "open_by_handle_at", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "perf_event_open", "pivot_root", "process_vm_readv", "process_vm_writev",
    "query_module", "quotactl", "quotactl_fd", "reboot", "request_key", "set_mempolicy",
    "setns", "settimeofday", "stime", "swapoff", "swapon", "sysfs", "_sysctl", "syslog",
    "umount", "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vm86", "vm86old",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fanotify_init", "lookup_dcookie", "vhangup",
)  # fmt: skip
# Beyond Docker's default: a tool has no business tracing anything, nor taking another
# process's descriptors (a session's agent's, say).
EXTRA_DENIED = ("ptrace", "pidfd_getfd")
# Refused when nothing charges the call's memory as a whole (no cgroup: the runner sums
# the resident memory of its processes, ``_tree``). The pages of a memfd or a System V
# segment no process maps, queued System V messages and semaphore sets show in no
# process's resident size, and only rlimits far above memory_mb bound them.
# POSIX shared memory stays: its files are on /dev/shm, a tmpfs of disk_mb.
UNCOUNTED_MEMORY = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "ipc")
# Traced, rather than refused, in a frozen template's filter (``compiled_filter``).
TRACED = ("mount", "unshare")
# Refused with ENOSYS so that the C library falls back to a call the filter can inspect:
# clone3 and openat2 pass their flags in memory, where seccomp cannot look.
FALLBACK = ("clone3", "openat2", "fchmodat2")

S_ISUID, S_ISGID = 0o4000, 0o2000
O_CREAT, O_TMPFILE_BIT = 0o100, 0o20000000
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
# (syscall, index of its mode argument, index of its open flags argument or None)
MODE_SETTERS = (
    ("chmod", 1, None), ("fchmod", 1, None), ("fchmodat", 2, None),
    ("creat", 1, None), ("mknod", 1, None), ("mknodat", 2, None),
    ("open", 2, 1), ("openat", 3, 2),
)  # fmt: skip

SCMP_ACT_ALLOW = 0x7FFF0000
# Hands the call to a ptrace tracer, and fails it (ENOSYS) when none is attached.
SCMP_ACT_TRACE = 0x7FF00000
SCMP_CMP_MASKED_EQ = 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


class SeccompUnavailable(Exception):
    """libseccomp is missing or refused the filter."""


def _masked(arg: int, bits: int) -> _ArgCmp:
    return _ArgCmp(arg, SCMP_CMP_MASKED_EQ, bits, bits)


@functools.lru_cache(maxsize=4)
def compiled_filter(*, memory_counted: bool, traced: bool = False) -> bytes:
    """The BPF program (one per process and mode; it depends on nothing of a call).
    ``memory_counted``: a cgroup charges the tool's memory (else ``UNCOUNTED_MEMORY``).
    ``traced``: ``mount``, ``unshare`` and ``clone`` into new namespaces go to a ptrace
    tracer instead of failing (with no tracer attached they fail, ENOSYS): for fork mode's
    frozen template (``_frozen``), whose tracer makes those calls in it and in the calls
    it clones.

    Raises:
        SeccompUnavailable: libseccomp cannot be loaded or rejects a rule.
    """
    path = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(path, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable("libseccomp is not installed (apt-get install libseccomp2)") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    )  # fmt: skip
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("libseccomp could not start a filter")

    def rule(action: int, name: str, *conditions: _ArgCmp) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a system call of this architecture
        array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
        result = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
        if result < 0:
            raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-result)}")

    try:
        _add_rules(rule, memory_counted, traced)
        sink = os.memfd_create("runner-seccomp-export", os.MFD_CLOEXEC)
        try:
            result = lib.seccomp_export_bpf(ctx, sink)
            if result < 0:
                raise SeccompUnavailable(f"libseccomp could not export the filter: {os.strerror(-result)}")
            program = os.pread(sink, os.fstat(sink).st_size, 0)
        finally:
            os.close(sink)
    finally:
        lib.seccomp_release(ctx)
    return program


def _add_rules(rule: Callable[..., None], memory_counted: bool, traced: bool) -> None:
    eperm = _errno_action(errno.EPERM)
    for name in (*DOCKER_DENIED, *EXTRA_DENIED, *(() if memory_counted else UNCOUNTED_MEMORY)):
        rule(SCMP_ACT_TRACE if traced and name in TRACED else eperm, name)
    for name in FALLBACK:
        rule(_errno_action(errno.ENOSYS), name)
    for flag in NAMESPACE_FLAGS:
        rule(SCMP_ACT_TRACE if traced else eperm, "clone", _masked(0, flag))
    for name, mode_arg, flags_arg in MODE_SETTERS:
        for bit in (S_ISUID, S_ISGID):
            if flags_arg is None:
                rule(eperm, name, _masked(mode_arg, bit))
            else:  # the mode argument means something only when a file is created
                for creating in (O_CREAT, O_TMPFILE_BIT):
                    rule(eperm, name, _masked(flags_arg, creating), _masked(mode_arg, bit))


def filter_fd(*, memory_counted: bool) -> int:
    """A fresh descriptor positioned at the start of the program, for ``bwrap --seccomp``.

    Raises:
        SeccompUnavailable: see ``compiled_filter``.
    """
    return sealed_memfd("runner-seccomp", compiled_filter(memory_counted=memory_counted))


def sealed_memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, read from its start (inheritable),
    sealed: whoever holds it can read it, none can change it (bubblewrap reads its
    arguments and filter from it after the runner has let it go)."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)  # no MFD_CLOEXEC: it is meant for the launcher
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
