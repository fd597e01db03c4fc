"""A `kiln serve` child process on a free 127.0.0.1 port, for the bench modes that load a
real server (`kv`, `pd`, `soak`)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kiln.distributed.hosts import free_port


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float,
                 poll_s: float = 0.2) -> None:
    """Return once `url`/health answers 200; raise with the log's tail if the server
    exits first or is not healthy within `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve at {url} exited with {proc.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"kiln serve at {url} not ready after {timeout_s} s:\n"
                       f"{log.read_text(errors='replace')[-3000:]}")


class ServerProcess:
    """`kiln serve ARGV` on a free port, optionally pinned to `cpus`; its output goes to
    `log`."""

    def __init__(self, argv: list[str], log: Path, cpus: list[int] | None = None,
                 env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, **(env or {})}
        if cpus is not None:
            env["OMP_NUM_THREADS"] = str(len(cpus))
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", "serve", *argv, "--port",
             str(port)], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.proc, self.url, self.log, timeout_s)

    def metrics(self, prefix: str = "kiln:") -> dict[str, float]:
        """The unlabelled and labelled samples of /metrics whose names start with
        `prefix`, by their full name."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def kv_metrics(self) -> dict[str, float]:
        return self.metrics("kiln:kv_transfer_")

    def rss_bytes(self) -> int | None:
        """The server's resident memory (Linux), None once it has exited."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        stop_process(self.proc, 30.0)


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
