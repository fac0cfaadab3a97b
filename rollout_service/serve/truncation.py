"""``truncate_prompt_tokens`` / ``truncation_side``: a prompt cut to its first or last N ids, as vLLM's
renderer cuts it (``vllm.renderers.params.TokenizeParams``).

- N = -1 is the longest prompt the context allows: ``max_model_len`` less one when the request
  names a ``max_tokens`` (room for one generated id), ``max_model_len`` otherwise;
- N above ``max_model_len`` is a 400 naming ``truncate_prompt_tokens``; N = 0 leaves no prompt (400);
- ``max_tokens`` is then at most the room the cut prompt leaves (:func:`fitted`);
- the side is the request's, else ``left`` (keep the last N): vLLM's server loads its tokenizer with
  ``truncation_side="left"`` (``vllm.tokenizers.get_tokenizer``), whatever the model's tokenizer says.

Only where nothing is recorded: completions, and chat completions without a rollout id. Under a
rollout id a cut prompt is not the history the rollout holds (docs/data-plane.md).
"""

from __future__ import annotations

from rollout_service.serve.protocol.envelope import ServiceError, bad_request


def fitted(requested: int | None, prompt_len: int, max_model_len: int) -> int | None:
    """A cut prompt's ``max_tokens``: as vLLM's ``get_max_tokens`` does, at most the room the cut left."""
    room = max_model_len - prompt_len
    if requested is None or room < 1 or requested > max_model_len:  # beyond the context: the usual 400
        return requested
    return min(requested, room)


DEFAULT_SIDE = "left"


def truncated(ids: list[int], keep: int | None, side: str | None, *, max_model_len: int,
              max_tokens: int | None) -> list[int]:
    """``ids`` cut to ``keep`` ids from ``side`` (see the module docstring); ``ids`` itself when no cut applies."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {max_model_len}. "
                          "Please request a smaller truncation size.", param="truncate_prompt_tokens")
    if keep < 0:
        keep = max(0, max_model_len - 1) if max_tokens else max_model_len
    if keep >= len(ids):
        return ids
    if keep == 0:  # nothing left to generate from (vLLM's input check refuses an empty prompt)
        raise ServiceError(400, "The decoder prompt cannot be empty (truncate_prompt_tokens=0)")
    return ids[-keep:] if (side or DEFAULT_SIDE) == "left" else ids[:keep]
