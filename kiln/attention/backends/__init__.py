from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend

__all__ = ["TorchPagedBackend", "TritonPagedBackend"]
