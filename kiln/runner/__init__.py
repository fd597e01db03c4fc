from kiln.runner.model_runner import CachedRequestState, ModelRunner, RunnerLimits

__all__ = ["CachedRequestState", "ModelRunner", "RunnerLimits"]
