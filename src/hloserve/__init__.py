"""hloserve: many StableHLO models per GPU, served over the KServe V2 / Triton gRPC protocol.

Layout: `hloserve.worker` runs a worker (`serve`), `hloserve.actors` holds the trio actors
(model queues, dispatcher), `hloserve.service` the gRPC front end, `hloserve.bundle` and
`hloserve.manifest` the bundle format, `hloserve._xla` every call into JAX.
"""

from hloserve.config import Config as Config
from hloserve.config import load_config as load_config

__version__ = "0.1.0"

__all__ = ["Config", "__version__", "load_config", "serve"]


def __getattr__(name: str) -> object:
    # `serve` imports JAX; keep `import hloserve` cheap for the CLI's --help and for config tools.
    if name == "serve":
        from hloserve.worker import serve

        return serve
    raise AttributeError(f"module 'hloserve' has no attribute {name!r}")
