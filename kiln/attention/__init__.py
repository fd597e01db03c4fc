from kiln.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionLayerSpec,
                                    AttentionMetadata)
from kiln.attention.layer import Attention
from kiln.attention.op import SPLITTING_OPS
from kiln.attention.selector import BACKENDS, select_backend

__all__ = ["Attention", "AttentionBackend", "AttentionCGSupport", "AttentionLayerSpec",
           "AttentionMetadata", "BACKENDS", "SPLITTING_OPS", "select_backend"]
