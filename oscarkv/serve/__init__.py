"""``oscarkv serve``: an OpenAI-compatible HTTP server for :class:`oscarkv.LLM` (FastAPI, uvicorn, pydantic,
prometheus-client: ``pip install 'oscar-kv[serve]'``).

Layers: :mod:`.protocol` (request models, error shape) <- :mod:`.loop` (the engine thread) and :mod:`.metrics`
<- :mod:`.app` (routes, validation against the model, streaming) <- :mod:`.server` (uvicorn). See
``docs/serving.md``.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"oscarkv.serve needs {e.name}: pip install 'oscar-kv[serve]'", name=e.name) from None

from .app import ServeConfig, build_app
from .loop import EngineLoop
from .server import Server

__all__ = ["EngineLoop", "ServeConfig", "Server", "build_app"]
