"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`code` is a string or null, as OpenAI's API has it ("model_not_found", "invalid_api_key",
...; vLLM sends the status as an int, which clients written for OpenAI do not expect).

Handlers raise `APIError` (or a helper below) for anything the client got wrong;
`install_error_handlers` turns it, Starlette's own HTTP errors (unknown route,
wrong method) and any unexpected exception into that body with the right status.
"""
import hmac
import logging
from http import HTTPStatus

logger = logging.getLogger("nanovllm")

# OpenAI's error types, by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               503: "server_error"}


class APIError(Exception):
    """An error answered to the client as-is: status, message, and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def check_api_key(request, api_key: bytes | None) -> None:
    """401 unless `request` carries `Authorization: Bearer <api_key>` (constant-time compare);
    nothing to check when no key is configured."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def check_model(model: str | None, served_model_names: list[str]) -> None:
    """404 unless `model` is None or one of the names this server answers to."""
    if model is not None and model not in served_model_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served_model_names[0]!r}",
                       "model", "model_not_found")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None):
    from fastapi.responses import JSONResponse
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def install_error_handlers(app) -> None:
    """Answer every error raised by a route in OpenAI's shape; never a bare traceback."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        return error_response(400, errors[0]["msg"] if errors else "invalid request", param)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        logger.exception("unexpected error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
