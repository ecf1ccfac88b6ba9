"""The ASGI app: one model behind the OpenAI, Anthropic and Ollama surfaces, with health and metrics.

Only assembly happens here: the surfaces (``openai.py``, ``anthropic.py``, ``ollama.py``), generation
(``generation.py``), the metrics (``metrics.py``) and what wraps every request
(``middleware.py``) each live in their own module.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from . import anthropic, fim, ollama, openai, responses, ui
from .common import ServedModel, Settings
from .generation import Server
from .limits import Limits
from .middleware import BodyLimit, BufferBudget, Gate, add_error_handlers


def create_app(spec: ServedModel, settings: Settings, limits: Limits | None = None) -> FastAPI:
    """The app serving SPEC; LIMITS: what clients may hold of it (the bodies' share here, the
    connections' in the uvicorn protocol lifecycle.serve runs it under)."""
    limits = limits or Limits()
    app = FastAPI(title="mlxspec", version=_version(),
                  description="OpenAI-, Anthropic- and Ollama-compatible API over one model, "
                              "with exact speculative decoding.")
    server = Server(spec, settings)
    app.state.server = server
    app.state.limits = limits
    app.state.buffered = BufferBudget(limits.max_buffered_bytes)  # request bodies' bytes held now
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, "queue_depth": server.worker.depth}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        w = server.worker
        batch = {"max_rows": w.max_batch, "rows": w.running, "steps": w.batch_steps, "row_steps": w.batch_row_steps}
        return PlainTextResponse(server.metrics.render(w.depth, spec.prompt_cache, batch),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                            "created": 0, "owned_by": "mlxspec"}]}

    if settings.ui:  # the chat page: before Ollama's "/", which it answers for non-browsers
        app.include_router(ui.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.include_router(ollama.router)
    app.include_router(fim.router)  # llama.cpp's /infill
    # the last added is the outermost: CORS (preflights need no key), the Host and key checks,
    # then the body limit (an unauthorized body is not read)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, budget=app.state.buffered,
                       body_timeout=limits.body_timeout)
    app.add_middleware(Gate, server=server)
    if settings.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    return app


def _version() -> str:
    from .. import __version__

    return __version__
