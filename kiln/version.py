"""kiln's version, importable without importing the engine."""
__version__ = "0.1.0"
