"""The distribution's version, a leaf: inner modules read it here, never through the package root
(whose lazy `serve` imports the worker)."""

__version__ = "0.1.0"
