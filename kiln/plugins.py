"""Plugins: code from other packages, found through Python entry points (vLLM's design).

Each group has a process boundary and a load time:

| group | loaded in | when |
|---|---|---|
| `kiln.general_plugins` | every kiln process: engine, each worker, the server | before any model is resolved (`load_general_plugins`) |
| `kiln.platform_plugins` | every process | on the first use of `kiln.platforms.current_platform` |
| `kiln.stat_logger_plugins` | where outputs are processed (`LLM`, `kiln serve`) | engine start-up |
| `kiln.endpoint_plugins` | the server, opt-in by name (`--endpoint-plugins`) | app build |
| `kiln.io_processor_plugins` | where requests enter (`LLM`, `kiln serve`), by name | engine start-up |

`KILN_PLUGINS=a,b` limits every group to those entry names ("" loads none). A plugin that
fails to load (or, for general plugins, to run) is logged as "Failed to load plugin
'<name>'" with its traceback; start-up goes on and it is not retried.

Discovery reads the installed distributions' entry points once per process.
"""
from __future__ import annotations

import functools
import importlib
import logging
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable

from kiln import envs

logger = logging.getLogger(__name__)

GENERAL_PLUGINS_GROUP = "kiln.general_plugins"
PLATFORM_PLUGINS_GROUP = "kiln.platform_plugins"
STAT_LOGGER_PLUGINS_GROUP = "kiln.stat_logger_plugins"
ENDPOINT_PLUGINS_GROUP = "kiln.endpoint_plugins"
IO_PROCESSOR_PLUGINS_GROUP = "kiln.io_processor_plugins"

_general_loaded = False


@functools.cache
def _entry_points(group: str) -> tuple[EntryPoint, ...]:
    """The group's installed entry points, read once per process: scanning the installed
    distributions is the only cost discovery has when no plugin is installed."""
    return tuple(entry_points(group=group))


def discover(group: str) -> list[EntryPoint]:
    """The group's installed entry points that KILN_PLUGINS allows, not loaded."""
    allowed = envs.KILN_PLUGINS
    return [ep for ep in _entry_points(group) if allowed is None or ep.name in allowed]


def load_plugins_by_group(group: str) -> dict[str, Callable[..., Any]]:
    """name -> the loaded entry point (a callable), for every allowed plugin of `group`
    that imports; one that fails is logged and left out."""
    plugins: dict[str, Callable[..., Any]] = {}
    for ep in discover(group):
        log = logger.debug if group == GENERAL_PLUGINS_GROUP else logger.info
        log("loading plugin %r (%s) of %s", ep.name, ep.value, group)
        try:
            plugins[ep.name] = ep.load()
        except Exception:
            logger.exception("Failed to load plugin '%s'", ep.name)
    return plugins


def call_plugins(plugins: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    """name -> what each plugin returned; one that raises is logged and left out."""
    results: dict[str, Any] = {}
    for name, func in plugins.items():
        try:
            results[name] = func()
        except Exception:
            logger.exception("Failed to load plugin '%s'", name)
    return results


def load_general_plugins() -> None:
    """Run every `kiln.general_plugins` entry once in this process. The flag is set
    before loading, so a plugin that fails is not retried (as in vLLM); plugins must be
    re-entrant, since every process runs them."""
    global _general_loaded
    if _general_loaded:
        return
    _general_loaded = True
    call_plugins(load_plugins_by_group(GENERAL_PLUGINS_GROUP))


def resolve_qualname(qualname: str) -> Any:
    """The object a qualified name ("pkg.mod:Name" or "pkg.mod.Name") names; a ValueError
    names a bad one."""
    module, sep, attr = qualname.partition(":")
    if not sep:
        module, _, attr = qualname.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import {qualname!r} ({exc}); write 'package.module:Name'") \
            from None
    return obj
