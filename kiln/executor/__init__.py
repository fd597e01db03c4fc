"""Executors: who runs the model for the engine (`uni`, `mp`, `external_launcher`), the
Worker they drive, and the name-to-class map (`make_executor`).
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "Executor": "abstract", "make_executor": "factory", "RunnerSpec": "worker",
    "Worker": "worker",
})
