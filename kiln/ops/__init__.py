"""kiln's own kernels and the thin dispatch functions models call instead of `F.*`."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "linear": "linear", "linear_quant": "linear", "load_tuning": "tuning",
    "lookup": "tuning",
})
