"""Helpers the benchmark scripts share: progress lines on stderr, a free
loopback port, and a process's memory as /proc shows it."""

import socket
import sys
from typing import Dict

HOST = "127.0.0.1"


def log(msg: str) -> None:
    """One progress line on stderr (stdout is for results)."""
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def proc_memory(pid: int) -> Dict[str, int]:
    """VmRSS and VmHWM of `pid`, in bytes; empty when the process is gone."""
    out: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
