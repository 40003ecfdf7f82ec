"""HTTP server: SGLang's native API and the OpenAI-compatible API over one scheduler thread.

Modules: protocol (request bodies), scheduler (the thread that owns the engine), context (shared
state and errors), stream (the event-loop side of a request), native and openai_api (endpoints),
app (the FastAPI app), launch (`specpilot serve`).
"""

from specpilot.server.app import create_app
from specpilot.server.context import ServerArgs

__all__ = ["ServerArgs", "create_app"]
