"""The trainer's collective group (gloo): every worker of every serving engine joins it, ranked
after the trainer (rank 0, which hosts the group's TCPStore); it is only usable by the engines it
was formed with, so a refit over another serving set is refused until it is formed again. A mixin of
:class:`~rollout_service.refit.controller.RefitController`, whose fleet view, refit lock and config
it uses. (The NCCL path's group: :mod:`rollout_service.refit.nccl`.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_service.config import RolloutServiceConfig
from rollout_service.fleet.types import FleetView
from rollout_service.refit.types import GROUP_UNKNOWN, MEMBERSHIP_CHANGED, RefitInProgress, WeightSyncNotInitialized


class WeightSyncGroups:
    config: RolloutServiceConfig
    _weight_sync: dict[str, Any] | None

    async def weight_sync_world_size(self) -> int:
        """Trainer (rank 0) + every worker of every serving engine."""
        view = await self._view()
        return 1 + len(view.members) * self.config.engine.tensor_parallel_size

    async def init_weight_sync(self, host: str, port: int, group_name: str, timeout_s: float | None = None) -> list[int]:
        """Every engine worker joins the trainer's dedicated gloo group (trainer = rank 0, hosting the
        TCPStore at host:port). The trainer joins concurrently (``TrainerClient.init_weight_sync``).
        Returns the workers' ranks. Also on a service whose ``refit.backend`` is nccl, when the
        trainer asks for gloo: the group is this service's own, whatever the engines started with."""
        if self._refit_lock.locked():
            raise RefitInProgress("cannot re-create the weight-sync group while a refit runs")
        view = await self._view()
        timeout = timeout_s or self.config.refit.step_timeout_s
        tp = self.config.engine.tensor_parallel_size
        world = 1 + len(view.members) * tp
        self._weight_sync = None
        calls = [
            m.handle.collective_rpc.remote(
                "rs_weight_sync_init", args=(host, port, world, 1 + i * tp, group_name, timeout), timeout=timeout
            )
            for i, m in enumerate(view.members)
        ]
        ranks = await asyncio.wait_for(asyncio.gather(*calls), timeout=timeout)
        self._weight_sync = {"host": host, "port": port, "group": group_name, "world_size": world, "timeout_s": timeout,
                             "epoch": view.epoch, "members": [list(m.key) for m in view.members]}
        self._weight_sync_closed = False
        return [r for per_engine in ranks for r in per_engine]

    async def close_weight_sync(self) -> None:
        self._weight_sync = None
        self._weight_sync_closed = True  # on purpose: a trainer's client does not form it again by itself
        await self.fleet.fan_out.remote("collective_rpc", "rs_weight_sync_close")

    async def check_weight_sync(self) -> None:
        """Raise WeightSyncNotInitialized if the group no longer matches the serving engines (the
        trainer asks before it sends: a broadcast into a group with a dead rank fails mid-way)."""
        self._check_weight_sync(await self._view())

    def _check_weight_sync(self, view: FleetView) -> None:
        """The gloo group has a rank per engine worker: it is only usable by the members it was built with."""
        if self._weight_sync is None:
            if getattr(self, "_weight_sync_closed", False):
                raise WeightSyncNotInitialized("the weight-sync group was closed (close_weight_sync): call "
                                               "init_weight_sync again")
            raise WeightSyncNotInitialized(GROUP_UNKNOWN)
        if self._weight_sync["members"] != [list(m.key) for m in view.members]:
            before = self._weight_sync["epoch"]
            self._weight_sync = None
            raise WeightSyncNotInitialized(
                f"{MEMBERSHIP_CHANGED} (fleet epoch {before} -> {view.epoch}: an "
                "engine was lost or replaced); call init_weight_sync again (TrainerClient does it by itself)")
