"""Errors of the other planes as HTTP answers, read from the errors themselves.

The on-policy core's errors (:mod:`rollout_service.onpolicy.errors`), the store's
(:mod:`rollout_service.store.base`) and the fleet's (:mod:`rollout_service.fleet.types`) each say
their HTTP ``status``, ``error_type``, ``code`` and ``param`` where they are defined; this module
renders them as :class:`ServiceError` and adds nothing. The engine's own refusal of a request is
vLLM's ``VLLMClientError`` (the simulated engine's: a ``SamplingParamsError``), which says which
parameter it refused: a 400.
"""

from __future__ import annotations

from rollout_service.engine.sampling import SamplingParamsError
from rollout_service.serve.protocol.envelope import ServiceError, bad_request


def http_error(exc: BaseException, *, param: str | None = None) -> ServiceError:
    """``exc`` as the answer it declares; ``param`` overrides the field it names (a rollout id in
    a header rather than the path, say)."""
    message = getattr(exc, "http_message", None) or str(exc)
    return ServiceError(exc.status, message, type=exc.error_type, param=param or getattr(exc, "param", None),
                        code=exc.code)


def engine_refusal(exc: BaseException) -> ServiceError | None:
    """The engine's own request validation (vLLM's ``VLLMClientError``, e.g. a tool's parameters
    schema its grammar backend cannot compile for a forced tool_choice): a 400, not a 500."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # pragma: no cover - a replica always has vLLM
        return None
    refusals = (VLLMClientError, SamplingParamsError)  # the latter: the simulated engine's, over Ray
    cause = exc if isinstance(exc, refusals) else getattr(exc, "cause", None)
    if not isinstance(cause, refusals):
        return None
    message = " ".join(str(cause.args[0] if cause.args else cause).split())[:500]
    param = getattr(cause, "parameter", None) or getattr(cause, "param", None)
    return bad_request(f"the engine refused the request: {message}", param=param, code="engine_rejected_request")


def key_reused(key: str) -> ServiceError:
    return ServiceError(422, f"Idempotency-Key {key!r} was used for a different request on this rollout; a retry must "
                        "repeat its request exactly", param="Idempotency-Key", code="idempotency_key_reused")

