"""How the store reaches Redis: which client a URL asks for (one server, a Redis Cluster, a
primary found through Sentinel) and the client arguments behind the store's deadlines."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from rollout_service.config import StoreConfig


def parse_redis_url(url: str) -> tuple[str, bool]:
    """Split our cluster marker off a Redis URL: ``redis+cluster://`` / ``rediss+cluster://`` or a
    ``cluster=true`` query parameter. Returns the URL redis-py understands and whether it is a cluster.

    StoreConfig has only ``redis_url``, so the URL itself has to say which client to build.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    cluster = False
    if scheme.endswith("+cluster"):
        cluster, scheme = True, scheme[: -len("+cluster")]
    query = []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k.lower() == "cluster":
            cluster = cluster or v.lower() in ("1", "true", "yes", "on")
        else:
            query.append((k, v))
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r} "
                         "(redis://, rediss://, unix://, redis+cluster://, redis+sentinel://)")
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)), cluster


def parse_sentinel_url(url: str) -> dict[str, Any] | None:
    """``redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB]`` (``rediss+``
    for TLS to the primary): the sentinels, the monitored service and the database, or None for any
    other URL. The credentials are the primary's (sentinels usually have none)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis+sentinel", "rediss+sentinel"):
        return None
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, pw = cred.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    sentinels = []
    for hostport in filter(None, netloc.split(",")):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a sentinel must be HOST:PORT, got {hostport!r} in {url!r}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"a Sentinel URL is redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB], got {url!r}")
    return {"sentinels": sentinels, "service": unquote(path[0]), "db": int(path[1]) if len(path) == 2 else 0,
            "username": username, "password": password, "ssl": scheme.startswith("rediss")}


def client_deadlines(config: StoreConfig) -> dict[str, Any]:
    """redis-py client arguments for the store's deadlines, named in the config rather than left to
    the library's defaults: a command waits at most ``store.timeout_s`` for Redis's answer (a
    stalled or unreachable Redis), a connection ``store.connect_timeout_s``; a command that failed
    on a connection error or a timeout is sent again up to ``store.retries`` times with exponential
    backoff and jitter (appends are idempotent under it). TCP keepalive finds dead peers on idle
    pooled connections."""
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    return {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_keepalive": True,
        "retry": Retry(ExponentialWithJitterBackoff(cap=config.retry_backoff_cap_s, base=0.05), config.retries),
    }
