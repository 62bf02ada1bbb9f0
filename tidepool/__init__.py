"""Tidepool, a multi-tenant LLM job service: the one import package the project installs.

    tidepool.service   the web side: Flask app factory, API, admin panel, and the ledger core (service/ledger/)
    tidepool.workers   the gpu/cpu workers, beat and the CLI; tidepool.workers.engine, the inference engine
    tidepool.kernels   attention and fused kernels (Triton, native CPU), each beside its torch reference

A wheel installs the three inside this package. A checkout keeps them in its top-level folders service/, workers/ and
kernels/ beside this one (an editable install maps them there; setup.py): with only the checkout on the path, the
subpackages are found from its root.
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "service").is_dir() and (_here.parent / "service" / "__init__.py").is_file():
    __path__.append(str(_here.parent))

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    """`from tidepool import LLM, SamplingParams`: the engine, imported (with torch) only when asked for."""
    if name in __all__:
        from tidepool.workers import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'tidepool' has no attribute {name!r}")
