"""One replica of `kiln serve -dp N`: `python -m kiln.entrypoints.openai.dp_child PARENT_PID
CPUS serve ARGS...` ties itself to the front, then runs `kiln serve ARGS...` in this process.

The tie is made here, in the child, as kiln's mp workers make theirs (`_die_with_parent`
in kiln/executor/multiproc.py): setting it between fork and exec (`preexec_fn`) is unsafe
once the front has threads, and importing torch starts one.
"""
from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys


def die_with_parent(parent: int) -> None:
    """Linux: the kernel SIGKILLs this process when the front dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the front died before prctl: nobody would stop us
        os._exit(1)


def main() -> None:
    parent, cpus, *argv = sys.argv[1:]
    die_with_parent(int(parent))
    if cpus and hasattr(os, "sched_setaffinity"):  # before any thread: all inherit it
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    # `python -m kiln.cli.main ARGS`, by name: no import of the CLI layer from here.
    sys.argv = ["kiln", *argv]
    runpy.run_module("kiln.cli.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
