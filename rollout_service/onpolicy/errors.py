"""Errors of the on-policy core, each meant to map to one HTTP status in the Serve shell.

The core never guesses: a history it cannot continue exactly is either forked (policy ``fork``),
refused (:class:`HistoryConflict`, 409), or — when the chat template itself cannot express the
conversation — refused as a bad request (:class:`UnsupportedConversation`, 400). Token data a
client echoes back in stateless mode that cannot be what the service returned (wrong types,
lengths that disagree, ids outside the vocabulary) is refused as a bad request too
(:class:`InvalidEcho`, 400), before anything is built from it. A silent wrong prompt would be an
off-policy sample the trainer cannot detect.

Every error carries what the HTTP shell needs for OpenAI's error envelope, defined here and read
there: ``status``, ``error_type``, ``code`` and ``param`` (``messages[index].field`` where the
message and field are known).
"""

from __future__ import annotations


class OnPolicyError(Exception):
    """Base class; ``status`` is the HTTP status the shell answers with, ``error_type`` and ``code``
    the envelope's, ``param`` the request field at fault."""

    status: int = 400
    error_type: str = "invalid_request_error"
    code: str = "onpolicy_error"
    index: int | None = None
    field: str | None = None

    @property
    def param(self) -> str:
        if self.index is None:
            return "messages"
        return f"messages[{self.index}].{self.field}" if self.field else f"messages[{self.index}]"


class HistoryConflict(OnPolicyError):
    """The request's history differs from what the model actually saw (policy ``reject``: 409).

    ``index`` is the first differing message (``None`` for request-level fields such as ``tools``),
    ``field`` the first differing field of it: ``role``, ``content``, ``reasoning_content``,
    ``tool_calls``, ``tool_call_id``, ``missing`` (the request has fewer messages than the stored
    history), ``new_messages`` (the request adds nothing after the stored assistant output),
    ``tools``, or ``echo`` (stateless mode: the messages no longer render to the echoed ids).
    """

    status = 409
    error_type = "conflict_error"
    code = "non_monotonic_history"

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


class InvalidEcho(OnPolicyError, ValueError):
    """An echoed assistant message's token data is malformed (400, ``invalid_echo``).

    Stateless mode trusts nothing the client echoes without checking it: ``index`` is the message
    carrying the bad data, ``field`` the echo field at fault (``prompt_token_ids``,
    ``generation_token_ids``, ``generation_log_probs``, or ``finish_reason``), so the shell can
    name the parameter as :attr:`param`. Raised for a wrong type (a list of ints, not bools; a
    list of finite numbers), a missing field the others require, an empty id list, a logprob count
    that differs from the generated id count, an id outside ``[0, vocabulary size)``, or echo
    fields on a message that is not the assistant's. Raised before any state is built: nothing
    is half-applied. A ``ValueError`` too, for callers that catch the core's old error.
    """

    status = 400
    code = "invalid_echo"

    def __init__(self, index: int, field: str, message: str):
        super().__init__(f"messages[{index}].{field}: {message}")
        self.index = index
        self.field = field
        self.message = message


class InvalidPrefix(OnPolicyError, ValueError):
    """``required_prefix_token_ids`` is malformed (400, ``invalid_required_prefix``).

    Not a list, an entry that is not an integer (a bool is not one), or an id outside
    ``[0, vocabulary size)``. The ids go into the engine unchanged, so nothing downstream would
    catch them: they are checked first, like echoed ids.
    """

    status = 400
    code = "invalid_required_prefix"
    param = "required_prefix_token_ids"

    def __init__(self, message: str):
        super().__init__(f"required_prefix_token_ids: {message}")
        self.message = message


class PrefixNotContinuable(OnPolicyError):
    """The request's messages cannot continue its ``required_prefix_token_ids`` (400,
    ``prefix_not_continuable``).

    The prefix stands for the ids of the conversation up to and including its last assistant
    message; there is nothing to continue when the messages have no assistant message, or nothing
    after the last one, and the prefix contradicts the messages when that assistant message echoes
    a prompt + generation other than the prefix. ``index`` names the message when there is one.
    """

    status = 400
    code = "prefix_not_continuable"
    param = "required_prefix_token_ids"

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.message = message
        self.index = index
