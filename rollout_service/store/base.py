"""The one interface the rest of the service uses to keep rollouts durable.

The affinity replicas own the on-policy logic but hold no durable state: everything a rollout needs
to continue on another replica lives behind ``RolloutStore``. The contract is deliberately small —
load a whole rollout, append one turn conditioned on the turn counter, delete — so the Redis
implementation can make each of those one atomic server-side step, and the in-memory one can mirror
it exactly for unit tests of other modules.

Exceptions carry no Redis types, so the HTTP layer maps them without importing the store backend:
``InvalidRolloutId`` / ``InvalidTurnDelta`` -> 400, ``TurnConflict`` / ``RolloutAborted`` -> 409,
``StoreUnavailable`` -> 503, ``StoreFull`` -> 507.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Literal, Protocol, runtime_checkable

from rollout_service.onpolicy.types import RolloutState, TurnDelta

# Rollout ids end up inside Redis keys (between the ``{...}`` hash-tag braces), in SCAN patterns and
# in URL paths (``/v1/rollouts/{id}``): braces, glob characters and whitespace would break one of
# those, so the charset is the intersection that is safe everywhere. A slash only between two
# non-empty parts (the members of a group a call with ``n > 1`` opens are ``R/0 ... R/{n-1}``), and no
# part of dots alone (``a/..`` would be another path once a client normalises the URL).
ROLLOUT_ID_MAX_LEN = 128
_PART = r"(?!\.+(?:/|$))[A-Za-z0-9_.:\-]+"
_ROLLOUT_ID_RE = re.compile(r"(?=.{1,%d}$)%s(?:/%s)*" % (ROLLOUT_ID_MAX_LEN, _PART, _PART))
# The rule as a JSON Schema pattern for the OpenAPI schema, without its lookaheads (the length is the
# schema's maxLength, the dot-only parts its description): schema-driven generators (schemathesis)
# spend minutes generating strings for a pattern with lookaheads.
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9_.:\-]+(?:/[A-Za-z0-9_.:\-]+)*$"


class StoreError(Exception):
    """Base of every error a store raises on purpose. Each carries what the HTTP layer answers with:
    ``status``, ``error_type``, ``code``, and ``http_message`` (the message, said as the store's)."""

    status: int = 503
    error_type: str = "service_unavailable"
    code: str | None = "store_unavailable"
    param: str | None = None
    what = "rollout store error"

    @property
    def http_message(self) -> str:
        return f"{self.what}: {self}" if self.what else str(self)


class InvalidRolloutId(StoreError, ValueError):
    """A client-supplied rollout id cannot be stored as is (the HTTP layer answers 400)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_rollout_id"
    param = "rollout_id"
    what = ""

    def __init__(self, rollout_id: object, reason: str):
        self.rollout_id = rollout_id
        self.reason = reason
        super().__init__(f"invalid rollout id {rollout_id!r}: {reason}")


class InvalidTurnDelta(StoreError, ValueError):
    """A delta that would corrupt the history (ragged arrays, out-of-range ids, wrong segment).

    The store refuses it before writing anything, so a bug upstream cannot leave a half-written turn.
    """


class TurnConflict(StoreError):
    """Another call on the same rollout committed first (the HTTP layer answers 409).

    ``actual`` is the stored turn counter at the time of the attempt (0 when the rollout does not
    exist), so the caller can tell a lost race from a stale client.
    """

    status = 409
    error_type = "conflict_error"
    code = "concurrent_turn"
    what = ""

    def __init__(self, rollout_id: str, expected: int, actual: int):
        self.rollout_id = rollout_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"rollout {rollout_id!r}: expected turn {expected}, store is at turn {actual} "
            "(a concurrent request on this rollout committed first)"
        )


ROLLOUT_STATUSES = ("aborted", "stale")


class RolloutAborted(StoreError):
    """The rollout was aborted (``mark(..., "aborted")``): it takes no further turn (409); what it
    stored stays readable."""

    status = 409
    error_type = "conflict_error"
    code = "rollout_aborted"
    what = ""

    def __init__(self, rollout_id: str, reason: str | None = None):
        self.rollout_id = rollout_id
        self.reason = reason
        why = f" ({reason})" if reason else ""
        super().__init__(f"rollout {rollout_id!r} was aborted{why}: it takes no further turn; its stored turns stay "
                         "readable")


class StoreUnavailable(StoreError):
    """The backend cannot be reached, did not answer in time, or (``store.durability: replicated``)
    could not put a turn on enough replicas in time: 503 ``store_unavailable``, the message says
    which. In the last case, and when an append timed out, the turn may already be on the primary:
    the identical request again (same body or ``Idempotency-Key``) replays it, never generates twice."""

    what = "rollout store unavailable"


class StoreFull(StoreError):
    """The backend refused a write for lack of memory (Redis at ``maxmemory`` with ``noeviction``).

    Nothing of the refused write was stored: the history is as it was before the call, so the call
    can be retried once memory is freed (rollouts deleted or expired, ``maxmemory`` raised). The
    HTTP layer answers 507 (Insufficient Storage).
    """

    status = 507
    error_type = "server_error"
    code = "store_full"
    what = "rollout store is full, the turn was not stored"


class _Unchanged(enum.Enum):
    UNCHANGED = "unchanged"

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged.UNCHANGED
"""``load_if_changed``'s answer when the caller's copy is current (compare with ``is``)."""
Unchanged = Literal[_Unchanged.UNCHANGED]


def validate_rollout_id(rollout_id: object) -> str:
    if not isinstance(rollout_id, str):
        raise InvalidRolloutId(rollout_id, "must be a string")
    if not rollout_id:
        raise InvalidRolloutId(rollout_id, "must not be empty")
    if len(rollout_id) > ROLLOUT_ID_MAX_LEN:
        raise InvalidRolloutId(rollout_id, f"longer than {ROLLOUT_ID_MAX_LEN} characters")
    if not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise InvalidRolloutId(rollout_id, "allowed characters are letters, digits and - _ . : (and / between two "
                                           "non-empty parts; no part of dots alone)")
    return rollout_id


@runtime_checkable
class RolloutStore(Protocol):
    """Durable per-rollout history with optimistic concurrency on the turn counter.

    Appends are the only writes during a rollout and they never rewrite earlier turns, so the cost of
    a turn does not grow with the length of the history. Token ids are stored as int32 and logprobs
    as float32 (the engine's precision): a load returns exactly what was appended, after float32
    rounding of the logprobs and a JSON round trip of the turn records and messages.
    """

    async def load(self, rollout_id: str) -> RolloutState | None:
        """The whole rollout as one consistent snapshot, or None if unknown (or expired).

        The snapshot's ``incarnation`` names this lifetime of the rollout id (new after a delete or
        an expiry); None for a rollout stored before incarnations existed."""
        ...

    async def load_if_changed(
        self, rollout_id: str, known_turn: int, *, known_incarnation: str | None = None,
        known_status: str | None = None,
    ) -> RolloutState | None | Unchanged:
        """``UNCHANGED`` if the stored turn counter is ``known_turn`` (and, when given, the rollout's
        incarnation is ``known_incarnation``) and its status is ``known_status``, else the whole snapshot as ``load`` returns it, or
        None if unknown. One atomic step: the check and the snapshot see the same turn, and an
        unchanged rollout costs O(1), not O(history). A cache of loaded states (see
        ``store.cache``) revalidates with it; the incarnation guards against a rollout deleted
        and recreated to the same turn behind the cache's back.
        """
        ...

    async def append_turn(self, rollout_id: str, delta: TurnDelta, *, expected_turn: int) -> None:
        """Append one call's delta iff the stored turn counter equals ``expected_turn``.

        Atomic: either the whole delta is stored, the counter becomes ``delta.turn`` and the expiry of
        every key of the rollout is refreshed, or nothing changes and ``TurnConflict`` is raised.
        ``expected_turn=0`` creates the rollout. An aborted rollout refuses it (``RolloutAborted``)
        unless it is the call the abort ended (its record's ``finish_reason`` is ``abort``).
        """
        ...

    async def mark(self, rollout_id: str, status: str, reason: str = "", *, create: bool = False) -> bool | None:
        """Set the rollout's status (one of ``ROLLOUT_STATUSES``) and its reason: True if set,
        False if it is already aborted (an abort stands: idempotent, first reason kept), None if the
        rollout is unknown. Nothing else of the rollout changes. ``create``: an unknown rollout is
        created with no turn and this status (a group member whose first call is still running is
        aborted before it has stored anything: that call's answer is the one the store still takes)."""
        ...

    async def set_group_members(self, group_id: str, states: dict[str, str]) -> None:
        """Record rollouts as members of a group, each with the record of its last call under it (a
        string the store keeps as given: ``onpolicy.groups.call_entry``). The group expires
        ``ttl_seconds`` after its last write, as a rollout does after its last turn."""
        ...

    async def group_members(self, group_id: str) -> dict[str, str]:
        """A group's members -> their last call's record; {} for an unknown group."""
        ...

    async def delete(self, rollout_id: str) -> bool:
        """Free every key of the rollout; False if there was nothing to delete."""
        ...

    async def exists(self, rollout_id: str) -> bool: ...

    async def touch(self, rollout_id: str) -> bool:
        """Restart the expiry clock without appending (e.g. a long tool call); False if unknown."""
        ...

    async def ttl(self, rollout_id: str) -> float | None:
        """Seconds until the rollout expires, None if it does not exist."""
        ...

    async def claim_call(self, rollout_id: str, token: str, ttl_ms: int) -> str | None:
        """Claim the rollout for one call, seen by every replica, for ``ttl_ms`` unless renewed: None
        when ``token`` holds it now, else the holder's token ("" if it was released meanwhile)."""
        ...

    async def renew_call(self, rollout_id: str, token: str, ttl_ms: int) -> bool: ...

    async def release_call(self, rollout_id: str, token: str) -> None: ...

    async def ensure_replicated(self, rollout_id: str) -> None:
        """Return once what is stored of the rollout is as durable as an acknowledged append
        (store.durability); StoreUnavailable if it cannot be made so in time."""
        ...

    async def durability_status(self) -> dict[str, Any]:
        """What an acknowledged append is worth right now: ``{"durability", "ok", ...}``. Under
        store.durability replicated also ``required`` (min_replicas) and ``in_sync`` (the replicas
        that acknowledged a probe write, waited for as an append waits): ``ok`` is false when an
        append would be refused as short of replicas. Raises StoreUnavailable if it cannot tell."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
