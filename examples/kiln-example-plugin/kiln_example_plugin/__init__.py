"""An example kiln plugin package (see README.md)."""
from __future__ import annotations

import os


def register() -> None:
    """`kiln.general_plugins` entry: runs once in every kiln process, before any model is
    resolved. Re-entrant: registering the same lazy name again changes nothing."""
    if os.environ.get("KILN_EXAMPLE_PLUGIN_FAIL"):
        raise RuntimeError("the example plugin was asked to fail")
    from kiln import ModelRegistry

    # A lazy string: nothing is imported until a checkpoint names the architecture.
    ModelRegistry.register_model("ExampleLlamaForCausalLM",
                                 "kiln_example_plugin.model:ExampleLlamaForCausalLM")
    log = os.environ.get("KILN_EXAMPLE_PLUGIN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
