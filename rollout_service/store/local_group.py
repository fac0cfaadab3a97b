"""What the local Redis groups for drills and tests share (``LocalSentinelGroup``,
``LocalRedisCluster``): a context manager that stops every process it started even when its start
fails, one-shot commands to a node with a deadline, the count of a primary's replicas in sync, and
a bounded wait."""

from __future__ import annotations

import time


class LocalRedisGroup:
    host: str

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _command(self, port: int, *args: str):
        """One command to the node on ``port`` (2 s deadlines); a Redis error is an OSError."""
        import redis

        client = redis.Redis(host=self.host, port=port, socket_timeout=2, socket_connect_timeout=2)
        try:
            return client.execute_command(*args)
        except redis.RedisError as exc:
            raise OSError(str(exc)) from exc
        finally:
            client.close()

    def _online_replicas(self, port: int) -> int:
        """Replicas of the primary on ``port`` past their first sync (one still in it, wait_bgsave,
        holds nothing and cannot be promoted); 0 if the node does not answer."""
        try:
            info = self._command(port, "INFO", "replication")
        except OSError:
            return 0
        # redis-py parses INFO into a dict: slave<i> -> {"ip", "port", "state", ...}
        return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                   and v.get("state") == "online")

    @staticmethod
    def _wait(cond, timeout: float, what: str) -> None:
        from rollout_service.store.embedded import EmbeddedRedisError

        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(what)
            time.sleep(0.05)
