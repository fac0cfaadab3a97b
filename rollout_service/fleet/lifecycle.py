"""The fleet's ties to the world outside its engines: the Serve apps it serves (it stops once every
one of them is deleted) and the engine processes it kills by pid when an engine will not stop."""

from __future__ import annotations

import asyncio
from typing import Callable

import psutil
import ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

GONE_CHECKS = 3  # consecutive checks that find every attached app gone


async def wait_until_apps_gone(apps: Callable[[], set[str]], interval_s: float) -> None:
    """Return once every Serve app in ``apps()`` is gone (``serve delete``, ``serve shutdown``).

    Gone means: Serve answers and none of the apps is listed, or Serve's controller actor no longer
    exists — for ``GONE_CHECKS`` checks in a row, ``interval_s`` apart. A controller that is only
    restarting (it crashed; Ray restarts it) is not counted: losing every engine over a blip would
    be far worse than a few seconds of delay after a real deletion."""
    missing = 0
    while missing < GONE_CHECKS:
        await asyncio.sleep(interval_s)
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            gone = True  # serve shutdown
        else:
            try:
                listed = set((await asyncio.wait_for(asyncio.to_thread(serve.status), 30)).applications)
                attached = apps()
                gone = bool(attached) and not (attached & listed)
            except Exception:  # Serve's controller restarting: not evidence of a deletion
                gone = False
        missing = missing + 1 if gone else 0


@ray.remote(num_cpus=0)
def kill_processes(processes: list[tuple[int, float]]) -> int:
    """SIGKILL these processes if they are still the ones recorded (pid and start time match)."""
    killed = 0
    for pid, created in processes:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3:
                p.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return killed
