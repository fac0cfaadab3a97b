"""Methods added to every vLLM worker (``worker_extension_cls``), reached by ``collective_rpc``.

Weights must be received *inside* the worker: passing tensors as ``collective_rpc`` arguments
through AsyncLLM fails and can leave a half-loaded model (FIELD-NOTES). So the worker itself
reads a checkpoint path, pulls from the Ray object store, or joins a collective group, and loads
through vLLM's in-place ``reload_weights`` (copying into parameters directly has no effect on CPU,
where the model computes from packed copies).
"""

from __future__ import annotations

import hashlib
from typing import Any


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` etc.)."""

    def rs_weights_checksum(self) -> str:
        """sha256 over the model's parameters (name, dtype, bytes) as loaded in this worker."""
        import torch

        model = self.model_runner.get_model()
        h = hashlib.sha256()
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                t = p.detach().to("cpu").contiguous()
                h.update(name.encode())
                h.update(str(t.dtype).encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def rs_reload_from_path(self, path: str) -> None:
        """Load a HF-format checkpoint directory in place."""
        self.reload_weights(weights_path=path)

    def rs_reload_from_tensors(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Load (name, tensor) pairs that arrived inside this worker (object store, collective)."""
        self.reload_weights(weights_iterator=iter(named_tensors))

    def rs_param_shapes(self) -> list[tuple[str, list[int], str]]:
        """Checkpoint-format names are what the trainer sends; exposed for diagnostics."""
        model = self.model_runner.get_model()
        return [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
