"""The continuous-batching scheduler and what it hands the runner each step."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "CachedRequestData": "output", "EngineCoreOutput": "step",
    "ModelRunnerOutput": "output", "NewRequestData": "output", "Scheduler": "scheduler",
    "SchedulerOutput": "output", "SchedulerPolicy": "step", "SchedulerStats": "step",
})
