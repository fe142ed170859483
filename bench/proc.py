"""What the kernel says of a process's memory (Linux /proc), for the benches' peak figures."""


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of /proc/<pid>/status in KiB: VmRSS now, VmHWM its peak."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)
