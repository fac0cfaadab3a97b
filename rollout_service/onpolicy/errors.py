"""Errors of the on-policy core, each meant to map to one HTTP status in the Serve shell.

The core never guesses: a history it cannot continue exactly is either forked (policy ``fork``),
refused (:class:`HistoryConflict`, 409), or — when the chat template itself cannot express the
conversation — refused as a bad request (:class:`UnsupportedConversation`, 400). A silent wrong
prompt would be an off-policy sample the trainer cannot detect.
"""

from __future__ import annotations


class OnPolicyError(Exception):
    """Base class; ``status`` is the HTTP status the shell should answer with."""

    status: int = 400
    code: str = "onpolicy_error"


class HistoryConflict(OnPolicyError):
    """The request's history differs from what the model actually saw (policy ``reject``: 409).

    ``index`` is the first differing message (``None`` for request-level fields such as ``tools``),
    ``field`` the first differing field of it: ``role``, ``content``, ``reasoning_content``,
    ``tool_calls``, ``tool_call_id``, ``missing`` (the request has fewer messages than the stored
    history), ``new_messages`` (the request adds nothing after the stored assistant output),
    ``tools``, or ``echo`` (stateless mode: the messages no longer render to the echoed ids).
    """

    status = 409
    code = "history_conflict"

    def __init__(self, index: int | None, field: str, message: str):
        super().__init__(message)
        self.index = index
        self.field = field
        self.message = message

    def to_dict(self) -> dict:
        return {"index": self.index, "field": self.field, "message": self.message}

    @classmethod
    def from_dict(cls, d: dict) -> "HistoryConflict":
        return cls(d.get("index"), d["field"], d["message"])


class UnsupportedConversation(OnPolicyError):
    """The chat template cannot express this conversation (400).

    Raised when the template raises (e.g. strict user/assistant alternation, no tool role, a
    required field missing), silently drops a message or the request's tools, or renders the
    previous assistant turn in a way its end cannot be located. ``index`` names the offending
    message when known.
    """

    status = 400
    code = "unsupported_conversation"

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.message = message
        self.index = index
