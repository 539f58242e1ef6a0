"""Errors the router turns into OpenAI-style error bodies."""

from __future__ import annotations

from pdserve.router.openai_protocol import ErrorInfo, ErrorResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class APIError(Exception):
    """A request that fails with an HTTP status and an OpenAI error body.

    ``param`` names the offending request field where known.
    """

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.status_code = status_code
        self.message = message
        self.param = param
        self.type = type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.status_code))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def not_supported(param: str, what: str | None = None) -> APIError:
    return APIError(400, f"{what or '`' + param + '`'} is not supported yet", param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "model")


def unavailable(message: str) -> APIError:
    return APIError(503, message)
