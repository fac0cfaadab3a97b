"""A Redis Cluster on one host: primaries and their replicas, each a real redis-server process tied
to this one, joined with ``redis-cli --cluster create``: for drills and scale runs of the store on
``redis+cluster://`` URLs (scripts/drill_sentinel.py --topology cluster, scripts/bench_scale.py
--redis-cluster). Never what ``up`` runs; a deployment brings its own cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from rollout_service.store.embedded import EmbeddedRedis, EmbeddedRedisError
from rollout_service.store.local_group import LocalRedisGroup


class LocalRedisCluster(LocalRedisGroup):
    """``primaries`` primaries (the 16384 slots split evenly) with ``replicas`` replicas each. A
    replica is promoted when its primary has not answered for ``node_timeout_ms``."""

    def __init__(self, directory: str | os.PathLike, *, primaries: int = 3, replicas: int = 1,
                 node_timeout_ms: int = 1000, host: str = "127.0.0.1", maxmemory: str | int | None = None):
        if primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        self.directory = Path(directory)
        self.host = host
        self.num_primaries, self.num_replicas = primaries, replicas
        self.node_timeout_ms = node_timeout_ms
        self.maxmemory = maxmemory
        self.nodes: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.host}:{self.nodes[0].port}"

    def start(self) -> str:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise EmbeddedRedisError("redis-cli not found on PATH: install it with `apt-get install -y redis-tools`")
        for i in range(self.num_primaries * (1 + self.num_replicas)):
            node = EmbeddedRedis(self.directory / f"node-{i}", host=self.host, maxmemory=self.maxmemory, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--repl-diskless-sync-delay", "0"])  # a replica's first sync now, not 5 s later
            node.start()
            self.nodes.append(node)
        subprocess.run([cli, "--cluster", "create", *[f"{self.host}:{n.port}" for n in self.nodes],
                        "--cluster-replicas", str(self.num_replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self._wait(lambda: all(self._state(n.port) == "ok" for n in self.nodes), 30, "the cluster did not form")
        self._wait(lambda: len(self.primaries()) == self.num_primaries
                   and self._replicas_online() >= self.num_primaries * self.num_replicas, 30,
                   "the replicas did not sync")
        return self.url

    def primaries(self) -> list[int]:
        """Ports of the nodes that serve slots now (as any live node sees it)."""
        for node in self.nodes:
            try:
                return sorted(int(line.split()[1].split(":")[1].split("@")[0])
                              for line in self._command(node.port, "CLUSTER", "NODES").decode().splitlines()
                              if "master" in line.split()[2] and "fail" not in line.split()[2] and len(line.split()) > 8)
            except OSError:
                continue
        return []

    def pid_of(self, port: int) -> int:
        return next(n.pid for n in self.nodes if n.port == port)

    def keys_per_primary(self) -> dict[int, int]:
        return {port: int(self._command(port, "DBSIZE")) for port in self.primaries()}

    def wait_for_failover(self, old_port: int, timeout: float = 30.0) -> float:
        """Seconds until another node serves the dead primary's slots and the cluster says ok."""
        t0 = time.monotonic()
        live = [n.port for n in self.nodes if n.port != old_port]

        def promoted() -> bool:
            try:
                return (old_port not in self.primaries() and len(self.primaries()) == self.num_primaries
                        and all(self._state(p) == "ok" for p in live))
            except OSError:
                return False

        self._wait(promoted, timeout, "no failover")
        return time.monotonic() - t0

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []

    # ------------------------------------------------------------------ plumbing
    def _state(self, port: int) -> str | None:
        try:
            info = self._command(port, "CLUSTER", "INFO").decode()
        except OSError:
            return None
        return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cluster_state:")),
                    None)

    def _replicas_online(self) -> int:
        return sum(self._online_replicas(port) for port in self.primaries())
