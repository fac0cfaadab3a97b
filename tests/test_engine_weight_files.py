"""Weight files an engine process left in /dev/shm when it died mid-transfer are swept at the next engine start."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from rollout_service.weights.staging import shm_dir, sweep_stale_files


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_files_of_dead_writers_are_removed_and_live_ones_kept():
    d = shm_dir()
    dead = os.path.join(d, f"rs-export-{_dead_pid()}-{uuid.uuid4().hex}.safetensors")
    mine = os.path.join(d, f"rs-stage-{os.getpid()}-{uuid.uuid4().hex}.safetensors")
    parent = os.path.join(d, f"rs-stage-{os.getppid()}-{uuid.uuid4().hex}.safetensors")
    other = os.path.join(d, f"not-ours-{uuid.uuid4().hex}.safetensors")
    for p in (dead, mine, parent, other):
        with open(p, "wb") as f:
            f.write(b"x" * 16)
    try:
        assert sweep_stale_files() >= 1
        assert not os.path.exists(dead)
        assert os.path.exists(mine) and os.path.exists(parent) and os.path.exists(other)
    finally:
        for p in (dead, mine, parent, other):
            if os.path.exists(p):
                os.unlink(p)
