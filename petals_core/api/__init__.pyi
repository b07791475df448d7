# The names petals_core.api exports, each loaded on first access (see petals_core._lazy).

from ._app import MAX_BODY_BYTES as MAX_BODY_BYTES, create_app as create_app
from ._engine import Engine as Engine
from ._errors import ApiError as ApiError
from ._records import (
    Chunk as Chunk,
    Limits as Limits,
    TokenLogprob as TokenLogprob,
    Usage as Usage,
)
from ._requests import (
    ChatRequest as ChatRequest,
    CompletionRequest as CompletionRequest,
    Message as Message,
    Sampling as Sampling,
    parse_chat_untrusted as parse_chat_untrusted,
    parse_completion_untrusted as parse_completion_untrusted,
)
from ._serve import ApiConfig as ApiConfig, RunningApi as RunningApi, serve_api as serve_api
