"""The on-disk compile cache: one directory per configuration, one artifact per
(unique piece, size or range).

    <root>/<key>/cache_key_factors.json     what the key was computed from (diagnosis)
    <root>/<key>/artifacts/<name>/          an Inductor artifact (unpacked, with .so files)
    <root>/<key>/artifacts/<name>/kiln_manifest.json   sha256 of every file in it
    <root>/<key>/locks/<name>.lock          serialises writers of one artifact
    <root>/<key>/graph.pkl (+ .sha256)      the traced graph, its inputs and piece table:
                                            a warm start rebuilds it without Dynamo

Writers build into a temporary sibling directory and rename it into place under the
artifact's file lock, so readers see a whole artifact or none. An artifact whose manifest
does not verify (missing, truncated or corrupted file) is a cache miss: it is removed with
a warning and rebuilt, never loaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from kiln import envs

from kiln.compiler.counter import compilation_counter

logger = logging.getLogger(__name__)

MANIFEST = "kiln_manifest.json"
FACTORS = "cache_key_factors.json"


def default_cache_root() -> Path:
    return envs.KILN_CACHE_DIR or envs.kiln_home() / "compile_cache"


def hash_factors(factors: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()
                          ).hexdigest()[:16]


class CompileCache:
    def __init__(self, root: Path, factors: dict[str, Any]) -> None:
        self.key = hash_factors(factors)
        self.dir = root / self.key
        (self.dir / "artifacts").mkdir(parents=True, exist_ok=True)
        (self.dir / "locks").mkdir(exist_ok=True)
        if not (self.dir / FACTORS).exists():
            _write_atomic(self.dir / FACTORS, json.dumps(factors, indent=2, sort_keys=True,
                                                         default=str))

    def path(self, name: str) -> Path:
        return self.dir / "artifacts" / name

    def load(self, name: str, loader: Callable[[Path], Any]) -> Any | None:
        """The loaded artifact, or None (missing, or broken and now removed)."""
        path = self.path(name)
        if not path.exists():
            return None
        problem = verify_artifact(path)
        intact = problem is None
        if intact:
            try:
                return loader(path)
            except Exception as exc:  # a loader failure is a miss, never a crash
                problem = f"failed to load ({type(exc).__name__}: {exc})"
        logger.warning("compile cache artifact %s %s; rebuilding it", path, problem)
        compilation_counter.num_cache_repairs += 1
        with FileLock(str(self.dir / "locks" / f"{name}.lock")):
            # Unless another process has meanwhile replaced a damaged copy with a good one.
            if intact or verify_artifact(path) is not None:
                shutil.rmtree(path, ignore_errors=True)
        return None

    def write_blob(self, name: str, data: bytes) -> None:
        """A small whole-file record next to the artifacts (atomic, checksummed)."""
        path, sum_path = self.dir / name, self.dir / f"{name}.sha256"
        tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        with FileLock(str(self.dir / "locks" / f"{name}.lock")):
            os.replace(tmp, path)
            _write_atomic(sum_path, hashlib.sha256(data).hexdigest())

    def read_blob(self, name: str) -> bytes | None:
        """The record, or None when it is missing or fails its checksum."""
        with FileLock(str(self.dir / "locks" / f"{name}.lock")):
            data = read_verified_blob(self.dir, name)
        if data is None and (self.dir / name).exists():
            logger.warning("compile cache record %s is corrupted; tracing again",
                           self.dir / name)
            compilation_counter.num_cache_repairs += 1
        return data

    def save(self, name: str, build: Callable[[Path], Any]) -> Any:
        """Run `build(tmp_dir)` and publish its directory as artifact `name`.

        Returns what `build` returned. When another process published a valid artifact
        first, ours is discarded (both are equivalent)."""
        final = self.path(name)
        with FileLock(str(self.dir / "locks" / f"{name}.lock")):
            tmp = final.with_name(f".{name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            result = build(tmp)
            write_manifest(tmp)
            if final.exists():
                if verify_artifact(final) is None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    return result
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        compilation_counter.num_compiled_artifacts_saved += 1
        return result


def write_manifest(artifact: Path) -> None:
    files = {str(p.relative_to(artifact)): _sha256(p) for p in sorted(artifact.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    _write_atomic(artifact / MANIFEST, json.dumps(files, indent=1))


def verify_artifact(artifact: Path) -> str | None:
    """None when every file listed in the manifest is present and intact, else why not."""
    try:
        files = json.loads((artifact / MANIFEST).read_text())
    except (OSError, ValueError):
        return "has no readable manifest"
    for rel, digest in files.items():
        p = artifact / rel
        if not p.is_file():
            return f"is missing {rel}"
        if _sha256(p) != digest:
            return f"has a corrupted {rel} (checksum mismatch)"
    return None


def read_verified_blob(entry: Path, name: str) -> bytes | None:
    """A cache entry's whole-file record if it matches its stored sha256, else None."""
    try:
        data = (entry / name).read_bytes()
        expected = (entry / f"{name}.sha256").read_text().strip()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == expected else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
