"""The chat page: a browser UI over this server's own OpenAI endpoint, served at ``/`` (to a
browser; other clients still get Ollama's "Ollama is running" there) with its files under
``/ui/``. Static files shipped in the package (``static/``), no build step and nothing fetched
from elsewhere. These routes need no API key: the page asks for it and sends it with each
request to /v1 (``/ui/info`` says whether one is needed)."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from . import ollama
from .common import APIError

router = APIRouter(include_in_schema=False)

UI_PREFIX = "/ui/"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# what the page may load and run: its own files and requests to this server, nothing else
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
          "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_ui_path(path: str) -> bool:
    """Whether PATH is the page's (answered without an API key)."""
    return path == "/" or path.startswith(UI_PREFIX)


@cache
def static_files() -> dict[str, bytes]:
    """The page's files by name: only these are served (read once: they ship in the package)."""
    folder = resources.files(__package__).joinpath("static")
    return {f.name: f.read_bytes() for f in folder.iterdir()
            if f.is_file() and any(f.name.endswith(ext) for ext in TYPES)}


def _file(name: str) -> Response:
    files = static_files()
    if name not in files:
        raise APIError(404, f"no such file: {name}", kind="not_found_error")
    kind = TYPES[name[name.rindex("."):]]
    return Response(files[name], media_type=kind.split(";")[0],
                    headers={"Content-Type": kind, "Content-Security-Policy": POLICY,
                             "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


def wants_page(request: Request) -> bool:
    """A browser asking for a page (it accepts HTML); Ollama's clients and curl do not."""
    return "text/html" in request.headers.get("accept", "")


@router.api_route("/", methods=["GET", "HEAD"])
async def page(request: Request):
    if not wants_page(request):
        return PlainTextResponse(await ollama.root())
    return _file("index.html")


@router.get("/ui/info")
async def info(request: Request):
    """What the page shows in its header, and whether it must ask for the API key."""
    server = request.app.state.server
    settings, spec = server.settings, server.spec
    draft = getattr(spec, "draft", None)
    return {"model": settings.model_name, "drafter": settings.drafter,
            "draft_model": getattr(draft, "name", None) if draft is not None else None,
            "depth": settings.depth, "needs_key": bool(settings.api_key),
            "max_tokens_cap": settings.max_tokens_cap}


@router.get("/ui/{name}")
async def ui_file(name: str):
    return _file(name)
