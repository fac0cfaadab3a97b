"""Local runtime set-up shared by the CLI and the tests: one single-node Ray on 127.0.0.1."""

from __future__ import annotations

import os
import tempfile
from typing import Any

RAY_ENV = {
    # Token auth would write ~/.ray/auth_token; a local dev cluster on loopback does not need it.
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Keeps a single-node cluster on 127.0.0.1 (otherwise the node IP is rewritten to eth0).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


# vLLM on this project's CPU machines: the worker inside the engine-core process (faster start, half
# the memory) and a 1 GiB KV cache. Engine actors get the same through their runtime_env.
LOCAL_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def apply_ray_env() -> None:
    """Set the defaults above; must run before ``import ray`` (Ray reads some of them at import)."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)


def apply_local_env() -> None:
    """Ray defaults plus the local CPU engine env: scripts and tests call this before importing ray."""
    apply_ray_env()
    for k, v in LOCAL_ENGINE_ENV.items():
        os.environ.setdefault(k, v)


def start_local_ray(num_cpus: int = 16, address: str | None = None) -> dict[str, Any]:
    """Connect to ``address`` (or RAY_ADDRESS) if given, else start a local single-node Ray.

    ``num_cpus`` is logical: the engines, affinity replicas and Serve proxy each reserve some, and a
    2-core machine must still place them all.
    """
    apply_ray_env()
    import ray

    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ctx = ray.init(address=address, namespace="rollout-service", ignore_reinit_error=True)
    else:
        # Socket paths must stay under 108 bytes: keep the temp dir short. On a loaded 2-core
        # machine the raylet can time out waiting for its agents: retry once before giving up.
        for attempt in range(2):
            temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
            try:
                ctx = ray.init(
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    _temp_dir=temp_dir,
                    _node_ip_address="127.0.0.1",
                    namespace="rollout-service",
                    runtime_env={"env_vars": {k: os.environ[k] for k in RAY_ENV}},
                    logging_level="WARNING",
                )
                break
            except Exception:
                if attempt == 1:
                    raise
                ray.shutdown()
    return {"address": ctx.address_info.get("gcs_address")}
