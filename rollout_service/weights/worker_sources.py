"""Where a worker's weights come from, and how they are read: a :class:`Source` (a checkpoint
directory, or checkpoint-format tensors in memory, with the receive buffers they are views of), the
readers of a checkpoint directory or of a safetensors file the engine actor wrote into one, the
background stage job (:class:`StageJob`) that reads or receives a source in a thread while the
engine generates, and the record of an NCCL round (:class:`Recording` copies what vLLM loads as it
passes, :func:`merged` completes it over the previous source). Used by the worker extension
(:mod:`rollout_service.weights.worker_extension`); standard library only at import time, safetensors
and vLLM imported where they are read.
"""

from __future__ import annotations

import os
import time
from typing import Any


class Source:
    """Where the weights came from: a checkpoint directory, or checkpoint-format tensors in memory."""

    def __init__(self, *, path: str | None = None, tensors: list[tuple[str, Any]] | None = None, buffers=None):
        assert path is not None or tensors is not None
        self.path = path
        self.tensors = tensors  # with a path too: that checkpoint read ahead (a staged refit)
        self.buffers = buffers  # receive buffers the tensors are views of (reused once dropped)

    @property
    def nbytes(self) -> int:
        if self.tensors is None:
            return 0
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def describe(self) -> str:
        return f"path {self.path}" if self.path else f"{len(self.tensors)} tensors in memory"

    def settled(self) -> "Source":
        """Once loaded: a checkpoint read ahead is again just its path (the memory is released)."""
        return Source(path=self.path) if self.path is not None and self.tensors is not None else self


class StagingFallback(RuntimeError):
    """This engine cannot hold a second copy of the weights for this refit: it stages inside the
    pause instead (the refit report says so)."""


class StageJob:
    """One background stage of refit ``token``: runs ``work`` (returns a :class:`Source`) in a
    worker thread; the poll that finds it done installs the source (``installed``)."""

    def __init__(self, work, token: str | None, collective: bool = False):
        import threading

        self.work = work
        self.token = token
        self.collective = collective
        self.installed = False
        self.finished = threading.Event()
        self.abandoned = False
        self.source: Source | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            source = self.work()
            if not self.abandoned:
                self.source = source
        except BaseException as exc:  # noqa: BLE001 - handed to the poll that collects it
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self.finished.set()

    def abandon(self) -> None:
        self.abandoned = True
        self.source = None


def checkpoint_bytes(path: str) -> int:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found in the engine worker: {path}")
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files vLLM's loader would read from a checkpoint directory (those its
    ``model.safetensors.index.json`` names, when it has one)."""
    import glob

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files

        files = filter_duplicate_safetensors_files(files, path, "model.safetensors.index.json")
    return files


def read_checkpoint(path: str) -> Source:
    """A checkpoint directory's tensors read into memory (it stays the source's path)."""
    from safetensors.torch import load_file

    files = checkpoint_files(path)
    if not files:
        raise StagingFallback(f"no *.safetensors in the checkpoint directory {path}")
    tensors: list[tuple[str, Any]] = []
    for file in files:
        tensors += list(load_file(file).items())
    return Source(path=path, tensors=tensors)


def read_file(path: str, delete: bool) -> Source:
    from safetensors.torch import load_file

    try:
        return Source(tensors=list(load_file(path).items()))
    finally:
        if delete:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class Recording:
    """The model as vLLM's weight-transfer engine sees it during an NCCL round: ``load_weights``
    copies each (name, tensor) it is given to CPU into ``sink`` (the receive buffers are reused),
    then the model loads it; everything else is the model's."""

    def __init__(self, model, sink: list):
        self._model, self._sink = model, sink

    def load_weights(self, weights):
        def tee():
            for name, tensor in weights:
                self._sink.append((name, tensor.detach().to("cpu", copy=True)))
                yield name, tensor

        return self._model.load_weights(tee())

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):  # vLLM's finalize sets flags on the model it was given
        if name in ("_model", "_sink"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._model, name, value)


def merged(base: Source, received: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The full state after a round that loaded ``received`` over ``base``: the last tensor of
    each received name, and ``base``'s for the names the round did not send."""
    new = dict(received)
    if base.tensors is not None:
        return [*((n, t) for n, t in base.tensors if n not in new), *new.items()]
    import glob

    from safetensors import safe_open

    missing = []
    files = sorted(glob.glob(os.path.join(base.path, "*.safetensors")))
    if not files:  # e.g. a hub id, not a directory: the full state cannot be recorded honestly
        raise RuntimeError(f"cannot record the weights of a partial NCCL round over {base.path!r}: no "
                           "*.safetensors there (engine.model must be a local checkpoint directory)")
    for file in files:
        with safe_open(file, "pt", device="cpu") as handle:
            missing += [(n, handle.get_tensor(n)) for n in handle.keys() if n not in new]
    return [*missing, *new.items()]


def tensors_of(source: Source):
    if source.tensors is not None:
        return iter(source.tensors)
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    import glob

    return safetensors_weights_iterator(sorted(glob.glob(os.path.join(source.path, "*.safetensors"))), False)
