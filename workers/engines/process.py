"""Engine processes: started detached (own session, logs in a file) so that a node agent
restart leaves them running and the next agent adopts them by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

MARKER_ENV = "VLM_ENGINE_INSTANCE"


def spawn(argv: list[str], env: dict[str, str], *, log_path: Path, instance_id: str, cwd: str,
          nice: int = 0) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env, MARKER_ENV: str(instance_id)}
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"\n=== start {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=full_env, cwd=cwd, start_new_session=True, close_fds=True,
        )
    if nice:
        # Set from here rather than in a preexec_fn (unsafe in the agent's threads): the
        # engine forks its workers only after seconds of imports, and they inherit it.
        try:
            os.setpriority(os.PRIO_PROCESS, process.pid, nice)
        except OSError:
            pass
    return process.pid


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def is_alive(pid: int | None, *, instance_id: str | None = None) -> bool:
    """True when `pid` runs and (if instance_id is given) is that instance's engine."""
    if not pid:
        return False
    _reap(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    if state in (b"Z", b"X"):
        return False
    if instance_id is not None:
        # The pid may have been reused by an unrelated process after a reboot.
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (FileNotFoundError, PermissionError):
            return False
        if f"{MARKER_ENV}={instance_id}".encode() not in environ.split(b"\0"):
            return False
    return True


def marked_processes(prefix: str) -> dict[int, str]:
    """Running processes whose engine marker starts with `prefix`: pid -> marker."""
    found = {}
    needle = f"{MARKER_ENV}={prefix}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        for item in environ.split(b"\0"):
            if item.startswith(needle):
                pid = int(entry)
                if is_alive(pid):
                    found[pid] = item.split(b"=", 1)[1].decode()
                break
    return found


def is_stopped(pid: int | None) -> bool:
    """True when the process is stopped by a signal (SIGSTOP): alive but doing nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (FileNotFoundError, IndexError, TypeError):
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def terminate(pid: int, *, grace: float = 10.0) -> None:
    """SIGTERM the engine's process group, then SIGKILL what is left after `grace` seconds.

    The whole group: a multi-process engine (vLLM's API server and engine core) keeps GPU
    memory in its children, which outlive a leader that crashed.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not is_alive(pid) and not group_alive(pid):
                return
            time.sleep(0.05)


def stop_marked(marker: str, *, grace: float = 5.0) -> int:
    """Stop every process group that holds a process carrying exactly `marker`."""
    groups = set()
    for pid, found in marked_processes(marker).items():
        if found == marker:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
    for group in groups:
        terminate(group, grace=grace)
    return len(groups)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
