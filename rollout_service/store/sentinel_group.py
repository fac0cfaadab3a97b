"""A Redis primary, its replicas and a quorum of Redis Sentinels on one host, each a real
redis-server process tied to this one: for drills and tests of ``store.durability`` and
``redis+sentinel://`` URLs (scripts/drill_sentinel.py, tests/test_store_replication.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rollout_service.store.embedded import (
    EmbeddedRedis,
    find_redis_server,
    free_port,
    ping_port,
    popen_tied_to_this_process,
)
from rollout_service.store.local_group import LocalRedisGroup


class LocalSentinelGroup(LocalRedisGroup):
    """A primary, its replicas and a quorum of Redis Sentinels on one host (each a real
    redis-server process tied to this one): for drills and tests of ``store.durability`` and
    ``redis+sentinel://`` URLs. Never what ``up`` runs; a deployment brings its own Sentinel."""

    SERVICE = "rollout-store"

    def __init__(self, directory: str | os.PathLike, *, replicas: int = 2, sentinels: int = 3,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 5000, host: str = "127.0.0.1",
                 maxmemory: str | int | None = None):
        self.directory = Path(directory)
        self.host = host
        self.num_replicas, self.num_sentinels = replicas, sentinels
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.maxmemory = maxmemory
        self.primary: EmbeddedRedis | None = None
        self.replicas: list[EmbeddedRedis] = []
        self.sentinel_ports: list[int] = []
        self._sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis+sentinel://{','.join(f'{self.host}:{p}' for p in self.sentinel_ports)}/{self.SERVICE}"

    def start(self) -> str:
        self.primary = EmbeddedRedis(self.directory / "primary", host=self.host, maxmemory=self.maxmemory)
        self.primary.start()
        for i in range(self.num_replicas):
            replica = EmbeddedRedis(self.directory / f"replica-{i}", host=self.host, maxmemory=self.maxmemory,
                                    extra_args=["--replicaof", self.host, str(self.primary.port)])
            replica.start()
            self.replicas.append(replica)
        self._wait(lambda: self._online_replicas(self.primary.port) >= self.num_replicas, 20,
                   "the replicas did not connect to the primary")
        binary = find_redis_server(None)
        quorum = self.num_sentinels // 2 + 1
        for i in range(self.num_sentinels):
            d = self.directory / f"sentinel-{i}"
            d.mkdir(parents=True, exist_ok=True)
            port = free_port(self.host)
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind {self.host}\ndir {d}\n"
                f"sentinel monitor {self.SERVICE} {self.host} {self.primary.port} {quorum}\n"
                f"sentinel down-after-milliseconds {self.SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.SERVICE} {self.failover_timeout_ms}\n")
            with open(d / "sentinel.log", "ab") as logf:
                self._sentinels.append(popen_tied_to_this_process(
                    [binary, str(conf), "--sentinel"], stdout=logf, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
            self.sentinel_ports.append(port)
            self._wait(lambda: ping_port(self.host, port), 10, f"sentinel {i} did not start")
        self._wait(lambda: all(self._sentinel_sees_replicas(p) for p in self.sentinel_ports), 30,
                   "the sentinels did not discover the replicas")
        return self.url

    def primary_port(self) -> int:
        """The primary's port as the sentinels name it now."""
        reply = self._command(self.sentinel_ports[0], "SENTINEL", "get-master-addr-by-name", self.SERVICE)
        return int(reply[1])

    def primary_pid(self) -> int:
        port = self.primary_port()
        return next(r.pid for r in [self.primary, *self.replicas] if r is not None and r.port == port)

    def wait_for_failover(self, old_port: int, timeout: float = 30.0) -> float:
        """Seconds until the sentinels name another primary and it answers as one."""
        t0 = time.monotonic()

        def promoted() -> bool:
            try:
                port = self.primary_port()
                return port != old_port and self._command(port, "ROLE")[0] == b"master"
            except OSError:
                return False

        self._wait(promoted, timeout, "no failover")
        return time.monotonic() - t0

    def stop(self) -> None:
        for proc in self._sentinels:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self._sentinels = []
        for server in [*self.replicas, self.primary]:
            if server is not None:
                server.stop()

    # ------------------------------------------------------------------ plumbing
    def _sentinel_sees_replicas(self, port: int) -> bool:
        try:
            return len(self._command(port, "SENTINEL", "replicas", self.SERVICE)) >= self.num_replicas
        except OSError:
            return False
