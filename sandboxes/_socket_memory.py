"""Whether a call's socket buffers went past their budget, read from its memory cgroup.

A cgroup limit on socket memory does not hold by itself. When a socket's charge would
pass it, the kernel still lets every socket keep a minimum (the first packet of an empty
receive queue, the send queue's head, its forward allocation): charged anyway, past the
limit. That minimum is tens of kB a socket; over thousands of loopback connections it is
hundreds of MB (more than ``memory_mb``) while no charge ever fails. What the kernel does
keep is the peak of what it charged, forced charges included. A peak above the limit
means sockets pinned more than the call was given: the backends then stop the attempt
as ``memory_limit`` (polled while it runs, checked once more when it ends), so such a call
never succeeds.

cgroup v1 counts TCP buffers apart from ``memory.limit_in_bytes``, in their own counter
(``memory.kmem.tcp.*``) with its own limit, which the backends set. v2 charges socket
memory to ``memory.max`` with the rest; only forced charges (sockets among them) take
``memory.peak`` past ``memory.max``.
"""

from __future__ import annotations

from pathlib import Path

# One quarter of memory_mb on top of it, for the sockets (v1 only): a tool that passes it
# queued far more than any normal use of a sandboxed tool's network does.
TCP_SHARE = 4
TCP_LIMIT_FILE = "memory.kmem.tcp.limit_in_bytes"
TCP_PEAK_FILE = "memory.kmem.tcp.max_usage_in_bytes"


def tcp_budget(memory_mb: int) -> int:
    """The bytes of TCP buffers a call may hold on cgroup v1."""
    return memory_mb * 1024 * 1024 // TCP_SHARE


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # gone with its cgroup, or "max"


def sockets_overran(version: int, memory: Path) -> bool:
    """Whether the cgroup whose memory controller directory is ``memory`` was ever charged
    past its limit: on v1 its TCP counter, on v2 the whole of ``memory.max``. False when
    that cannot be read (the cgroup is gone, no limit is set)."""
    if version == 1:
        peak, limit = _read_int(memory / TCP_PEAK_FILE), _read_int(memory / TCP_LIMIT_FILE)
    else:
        peak, limit = _read_int(memory / "memory.peak"), _read_int(memory / "memory.max")
    return peak is not None and limit is not None and peak > limit
