from kiln.attention.backends.torch_paged import TorchPagedBackend

__all__ = ["TorchPagedBackend"]
