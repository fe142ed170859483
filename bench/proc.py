"""What the kernel says of a process (Linux /proc): its memory, for the benches' peak
figures, and its CPU time and children, for their CPU per request."""

import os


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of /proc/<pid>/status in KiB: VmRSS now, VmHWM its peak."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _stat(pid: int | str) -> list[bytes]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def cpu_seconds(pid: int | str) -> float:
    """User plus system CPU time of a process, all its threads, so far (0 once it is gone)."""
    try:
        fields = _stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process, of its live descendants, and of the children it has reaped
    (cutime, cstime): PostgreSQL's whole work from its postmaster, including backends that
    have ended meanwhile."""
    try:
        fields = _stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    reaped = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    return reaped + sum(cpu_seconds(each) for each in descendants(pid))


def parent(pid: int | str) -> int:
    """The process's parent's pid."""
    return int(_stat(pid)[1])


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent(entry) == pid:
                    found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return found


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    tree, queue = [], [pid]
    while queue:
        tree.append(current := queue.pop())
        queue += children(current)
    return tree


def command_line(pid: int) -> str:
    """Its argv joined by spaces, or its title when it set one (vLLM's `VLLM::EngineCore`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""
