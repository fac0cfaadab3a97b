"""Moving whole state dicts in and out of an engine actor (engine side; no refit logic).

The EngineCore process that hosts vLLM's worker is not connected to Ray, and tensors cannot travel
as ``collective_rpc`` arguments (FIELD-NOTES), so the engine *actor* is the bridge: it resolves an
object ref and hands the tensors to the worker through one safetensors file in ``/dev/shm`` (same
node, page cache), or reads back the worker's current weights the same way. Used by the refit's
object-store transport and by the fleet, which brings a replacement engine to the current weights.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from typing import Any

STAGE_FILE = "rs_stage_safetensors_file"
EXPORT_CURRENT = "rs_export_current"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _shm_path(tag: str) -> str:
    return os.path.join(shm_dir(), f"rs-{tag}-{os.getpid()}-{uuid.uuid4().hex}.safetensors")


def sweep_stale_files() -> int:
    """Delete staging / export files of engine processes that are gone (killed mid-transfer, or a
    worker that finished writing after its caller timed out): each is a whole state dict in
    ``/dev/shm``, i.e. memory. The writer's pid is in the name. Returns how many were removed."""
    removed = 0
    directory = shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if not (name.startswith("rs-") and name.endswith(".safetensors") and len(parts) >= 4 and parts[2].isdigit()):
            continue
        pid = int(parts[2])
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_safetensors(state_dict, path: str) -> int:
    from safetensors.torch import save_file

    items = state_dict.items() if hasattr(state_dict, "items") else state_dict
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in items}
    save_file(tensors, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


async def stage_state_dict_ref(replica, refs: list, timeout_s: float | None) -> list[dict[str, Any]]:
    """Runs in the engine actor: resolve ``refs[0]`` (a ``{name: tensor}`` dict, or ``{"path": dir}``)
    and stage it in every worker (nothing is loaded yet). Returns the workers' stage results."""
    if not refs:
        raise ValueError("need one object ref of a state dict")
    state_dict = await refs[0]
    if isinstance(state_dict, dict) and set(state_dict) == {"path"}:
        return await replica.collective_rpc("rs_stage_path", args=(state_dict["path"],), timeout=timeout_s)
    path = _shm_path("stage")
    try:
        await asyncio.to_thread(write_safetensors, state_dict, path)
        del state_dict
        return await replica.collective_rpc(STAGE_FILE, args=(path, True), timeout=timeout_s)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: no host identity, the deadline is not checked across processes
        return ""


def host_deadline(seconds: float) -> list:
    """A deadline another process of this host can check (``[boot id, time.monotonic() + seconds]``:
    the monotonic clock is one per host; a worker on another node, or one that cannot tell its
    host, does not check it)."""
    return [_boot_id(), time.monotonic() + seconds]


def deadline_passed(deadline) -> bool:
    """Whether a :func:`host_deadline` has passed, as seen from this process (False when it is
    another host's, or None)."""
    if not deadline:
        return False
    boot, at = deadline
    return bool(boot) and boot == _boot_id() and time.monotonic() > at


async def object_store_stage(refs: list) -> tuple[str, list]:
    """Runs in the engine actor, for a stage in the background of its workers: resolve ``refs[0]``
    and name the worker staging call that reads it (``{"path": dir}``: that directory; a state
    dict: written to a ``/dev/shm`` file the worker reads and deletes, or
    :func:`release_object_store_stage` does)."""
    if not refs:
        raise ValueError("need one object ref of a state dict")
    state_dict = await refs[0]
    if isinstance(state_dict, dict) and set(state_dict) == {"path"}:
        return "rs_stage_path", [state_dict["path"]]
    path = _shm_path("stage")
    try:
        await asyncio.to_thread(write_safetensors, state_dict, path)
    except BaseException:
        release_object_store_stage(STAGE_FILE, [path])
        raise
    return STAGE_FILE, [path, True]


def release_object_store_stage(method: str, args: list) -> None:
    """The file :func:`object_store_stage` wrote, if the worker has not read (and deleted) it."""
    if method == STAGE_FILE and args and os.path.exists(args[0]):
        try:
            os.unlink(args[0])
        except FileNotFoundError:
            pass


async def export_current_weights(replica, timeout_s: float | None) -> dict[str, Any]:
    """Runs in the engine actor: the weights its workers currently serve, as a checkpoint-format
    ``{name: tensor}`` dict (received tensors) or ``{"path": dir}`` (a checkpoint directory)."""
    from safetensors.torch import load_file

    path = _shm_path("export")
    try:
        results = await replica.collective_rpc(EXPORT_CURRENT, args=(path,), timeout=timeout_s)
        first = next(r for r in results if r)  # worker rank 0 answers; TP peers hold the same state
        if first.get("path"):
            return {"path": first["path"]}
        return await asyncio.to_thread(load_file, path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
