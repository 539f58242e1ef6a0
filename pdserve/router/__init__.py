"""The router: OpenAI-compatible HTTP API, tokenizing, worker registry, routing, streaming.

``build_app(config)`` gives the FastAPI app; ``run_router(config)`` serves it
(blocking); ``python -m pdserve.router --model DIR`` does the same from a shell.
"""

from pdserve.router.config import RouterConfig

__all__ = ["RouterConfig", "build_app", "run_router"]


def __getattr__(name):  # lazy: importing the config must not pull in fastapi/transformers
    if name == "build_app":
        from pdserve.router.app import build_app
        return build_app
    if name == "run_router":
        from pdserve.router.server import run_router
        return run_router
    raise AttributeError(name)
