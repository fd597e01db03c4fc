"""kiln's own kernels and the thin dispatch functions models call instead of `F.*`."""
from kiln.ops.linear import linear

__all__ = ["linear"]
