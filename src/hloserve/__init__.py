"""hloserve: many StableHLO models per GPU, served over the KServe V2 / Triton gRPC protocol.

Layout, by layer (docs/development.md draws it): `hloserve.models` the bundle format and every
call into JAX, `hloserve.engine` and `hloserve.actors` the engine (model table, scheduling,
weights), `hloserve.api` the protocols over its data plane (gRPC, REST, health), and above them
`hloserve.frontends`, `hloserve.fleet` and `hloserve.export`; `hloserve.worker` runs a worker
(`serve`). A bundle's model.py uses `register_model`, `register_meta_model` and `NamedTensor`
from here.
"""

from hloserve._transport import asyncio_compat as _asyncio_compat  # noqa: F401  (before any module imports trio-asyncio)
from hloserve._version import __version__ as __version__
from hloserve.config import Config as Config
from hloserve.config import load_config as load_config
from hloserve.models.model_py import NamedTensor as NamedTensor
from hloserve.models.model_py import register_meta_model as register_meta_model
from hloserve.models.model_py import register_model as register_model

__all__ = [
    "Config",
    "NamedTensor",
    "__version__",
    "load_config",
    "register_meta_model",
    "register_model",
    "serve",
]


def __getattr__(name: str) -> object:
    # `serve` imports JAX; keep `import hloserve` cheap for the CLI's --help and for config tools.
    if name == "serve":
        from hloserve.worker import serve

        return serve
    raise AttributeError(f"module 'hloserve' has no attribute {name!r}")
