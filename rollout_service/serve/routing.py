"""The Serve request router of the app: Ray's consistent-hash router with Ray's own routing loop.

``ray.serve.experimental.consistent_hash_router.ConsistentHashRouter`` (Ray 2.60) maps each
rollout id to one replica, which is what we need (docs/data-plane.md). But it overrides the router's
task loop (``_fulfill_pending_requests``) with a copy of an older version of Ray's, without two
fixes the base class has since received:

- after a replica is chosen it ``break``s even when the request it popped was not the one
  fulfilled (the base keeps routing until its own request is done);
- a routing task that retires does not start a replacement when requests arrived meanwhile (the
  base does: "Start replacement tasks if routing work remains").

Either leaves a request with no task routing it: the call hangs until the client gives up. (A hang
of that kind seen in full test runs after a replica replacement also happened with this router, so
it has another cause too: docs/data-plane.md, "Known open problem".) The ring, the hashing and
``choose_replicas`` are unchanged (affinity is tested); only
the loop is Ray's current one (``RequestRouter._fulfill_pending_requests``), whose invariants cover
the consistent-hash router's own: it exits when nothing is pending and keeps a popped request's
routing going until that request is fulfilled.
"""

from __future__ import annotations

import os

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import RequestRouter

ROUTER_CLASS = "rollout_service.serve.routing:RolloutRouter"
DEPLOYMENT_NAME = "RolloutService"
ROLLOUT_HEADER = "x-rollout-id"
# The Serve proxy reads this before it starts; every launch mode sets it (runtime.RAY_ENV, the
# KubeRay manifests, docs for `serve run` / `serve deploy`).
SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def haproxy_mode() -> bool:
    """Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1`` before Ray starts): HAProxy hashes
    ``X-Rollout-Id`` to a replica that serves HTTP itself; no custom request router is allowed."""
    return os.environ.get(HAPROXY_ENV) == "1"


class RolloutRouter(ConsistentHashRouter):
    """Consistent hashing on the request's session id (= rollout id), strict (no fallback replica)."""

    _fulfill_pending_requests = RequestRouter._fulfill_pending_requests
