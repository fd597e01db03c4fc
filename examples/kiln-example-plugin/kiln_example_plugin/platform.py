"""The example's platform: a CPU platform that adjusts the engine config."""
from __future__ import annotations

import os
from typing import Any

from kiln.platforms.cpu import CpuPlatform


def detect() -> str | None:
    """`kiln.platform_plugins` entry: the platform's qualified name when its hardware is
    present, else None. (Here: when KILN_EXAMPLE_PLATFORM=1.)"""
    if os.environ.get("KILN_EXAMPLE_PLATFORM") == "1":
        return "kiln_example_plugin.platform:ExamplePlatform"
    return None


class ExamplePlatform(CpuPlatform):
    configs_checked = 0

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        cls.configs_checked += 1
        config.enable_prefix_caching = False  # e.g. a device whose cache reuse is unsafe
