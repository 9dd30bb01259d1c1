"""ptrace on x86-64 through ctypes, for a frozen template (``_frozen``): seize a process, stop it,
and make system calls in it (and in the processes it is made to clone) while it stays
stopped. Every request must come from the one thread that seized the tracee.
"""

from __future__ import annotations

import collections
import ctypes
import os
import platform
import random
import signal
import time

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.ptrace.restype = ctypes.c_long
_LIBC.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)

PEEKTEXT, CONT, SINGLESTEP, GETREGS, SETREGS, DETACH = 1, 7, 9, 12, 13, 17
SETOPTIONS, GETEVENTMSG, SEIZE, INTERRUPT = 0x4200, 0x4201, 0x4206, 0x4207
O_TRACEFORK, O_TRACECLONE, O_TRACESECCOMP, O_EXITKILL = 0x2, 0x8, 0x80, 0x100000
EVENT_FORK, EVENT_CLONE, EVENT_SECCOMP, EVENT_STOP = 1, 3, 7, 128
WALL = 0x40000000
SYSCALL_INSN = 0x050F  # `syscall`, little-endian
SYS_READ = 0
_REGS = [
    "r15",
    "r14",
    "r13",
    "r12",
    "rbp",
    "rbx",
    "r11",
    "r10",
    "r9",
    "r8",
    "rax",
    "rcx",
    "rdx",
    "rsi",
    "rdi",
    "orig_rax",
    "rip",
    "cs",
    "eflags",
    "rsp",
    "ss",
    "fs_base",
    "gs_base",
    "ds",
    "es",
    "fs",
    "gs",
]
_ARGS = ("rdi", "rsi", "rdx", "r10", "r8", "r9")
_WORD = (1 << 64) - 1


class Regs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_ulonglong) for name in _REGS]


class TraceError(OSError):
    """A ptrace request failed, or a tracee stopped other than as expected."""


def supported() -> str | None:
    """Why ptrace injection cannot run here, or None."""
    return None if platform.machine() == "x86_64" else f"x86-64 only, not {platform.machine()}"


def request(kind: int, pid: int, addr: int = 0, data: int = 0) -> int:
    ctypes.set_errno(0)
    result = int(_LIBC.ptrace(kind, pid, ctypes.c_void_p(addr), ctypes.c_void_p(data)))
    error = ctypes.get_errno()
    if result == -1 and error:
        raise TraceError(error, f"ptrace({kind:#x}, {pid}): {os.strerror(error)}")
    return result


def regs_of(pid: int) -> Regs:
    regs = Regs()
    request(GETREGS, pid, 0, ctypes.addressof(regs))
    return regs


def set_regs(pid: int, regs: Regs) -> None:
    request(SETREGS, pid, 0, ctypes.addressof(regs))


def stop_in_read(pid: int, fd: int, tries: int) -> Regs:
    """Interrupt ``pid`` (seized) until it is found stopped in a ``read`` of ``fd``, up to
    ``tries`` times about 10 ms apart; its registers there.

    Raises:
        TraceError: not found there (the message counts where it was found instead).
    """
    where: collections.Counter[int] = collections.Counter()
    for _ in range(tries):
        request(INTERRUPT, pid)
        event, _ = stop_of(pid)
        while event != EVENT_STOP:
            # A signal on its way first: dropped, so its read goes on (delivered, its
            # handler would run and the stop would come in it).
            request(CONT, pid)
            request(INTERRUPT, pid)
            event, _ = stop_of(pid)
        regs = regs_of(pid)
        if regs.orig_rax == SYS_READ and regs.rdi == fd:
            return regs
        where[regs.orig_rax if regs.orig_rax < 1 << 63 else -1] += 1  # -1: not in a system call
        request(CONT, pid)
        time.sleep(random.uniform(0.005, 0.015))  # noqa: S311  # never in step with a timer of the tool's
    raise TraceError(0, f"process {pid} never waited in its read of {fd} ({dict(where)})")


def stop_of(pid: int) -> tuple[int, int]:
    """Wait for ``pid``'s next stop: (the ptrace event or 0, the stopping signal)."""
    _, status = os.waitpid(pid, WALL)
    if not os.WIFSTOPPED(status):
        raise TraceError(0, f"tracee {pid} ended (status {status:#x})")
    return (status >> 16) & 0xFF, os.WSTOPSIG(status)


def event_message(pid: int) -> int:
    value = ctypes.c_ulong()
    request(GETEVENTMSG, pid, 0, ctypes.addressof(value))
    return value.value


class Injector:
    """System calls made in a stopped tracee from its ``base`` registers, whose ``rip``
    follows a ``syscall`` instruction (checked): that instruction is run again with the
    call's number and arguments, one step, and the registers are put back at ``close``.
    A clone made so leaves its child stopped and traced too (``children``)."""

    def __init__(self, pid: int, base: Regs) -> None:
        self.pid = pid
        self.base = Regs.from_buffer_copy(base)
        word = request(PEEKTEXT, pid, base.rip - 2) & 0xFFFF
        if word != SYSCALL_INSN:
            raise TraceError(0, f"process {pid} is not stopped after a system call")
        self.children: list[int] = []
        self.approved = 0  # calls that the seccomp filter handed to us, each one ours
        self._memory: int | None = None
        self._scratch = 0
        self._used = 0

    def syscall(self, number: int, *args: int) -> int:
        regs = Regs.from_buffer_copy(self.base)
        regs.rip, regs.rax, regs.orig_rax = self.base.rip - 2, number, _WORD
        for name, value in zip(_ARGS, args, strict=False):
            setattr(regs, name, value & _WORD)
        set_regs(self.pid, regs)
        request(SINGLESTEP, self.pid)
        while True:
            event, sig = stop_of(self.pid)
            if event in (EVENT_FORK, EVENT_CLONE):
                self.children.append(event_message(self.pid))
            elif event == EVENT_SECCOMP:
                self.approved += 1  # the filter asks the tracer: this call is ours, go on
            elif event == 0 and sig != signal.SIGTRAP:
                pass  # a signal it was sent, before the step: dropped, it handles none
            else:
                break  # the step is done
            request(SINGLESTEP, self.pid)
        result = int(regs_of(self.pid).rax)
        return result - (1 << 64) if result >= 1 << 63 else result

    def checked(self, number: int, *args: int) -> int:
        result = self.syscall(number, *args)
        if result < 0:
            raise TraceError(-result, f"system call {number} in {self.pid}: {os.strerror(-result)}")
        return result

    def put(self, data: bytes) -> int:
        """``data`` in a scratch page of the tracee's (mapped at the first use): its address."""
        if self._memory is None:
            self._scratch = self.checked(9, 0, 4096, 3, 0x22, -1, 0)  # mmap RW, private anonymous
            self._memory = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        address = self._scratch + self._used
        self._used += (len(data) + 15) & ~15
        if self._used > 4096:
            raise TraceError(0, "the scratch page is full")
        os.pwrite(self._memory, data, address)
        return address

    def read(self, address: int, size: int) -> bytes:
        """``size`` bytes of the tracee's memory at ``address`` (after a ``put``)."""
        assert self._memory is not None
        return os.pread(self._memory, size, address)

    def text(self, value: str) -> int:
        return self.put(value.encode() + b"\0")

    def __enter__(self) -> Injector:
        return self

    def __exit__(self, *_: object) -> None:
        self.forget()

    def forget(self) -> None:
        """Close the descriptor of the tracee's memory (after ``close``, or when the
        tracee is given up)."""
        if self._memory is not None:
            os.close(self._memory)
            self._memory = None

    def close(self, result: int | None = None) -> None:
        """Unmap the scratch page and put the registers back (``rax``: ``result``, as if
        the system call it stopped after returned that, and nothing to restart)."""
        if self._memory is not None:
            self.forget()
            self.checked(11, self._scratch, 4096)  # munmap
        regs = Regs.from_buffer_copy(self.base)
        if result is not None:
            regs.rax, regs.orig_rax = result & _WORD, _WORD
        set_regs(self.pid, regs)
