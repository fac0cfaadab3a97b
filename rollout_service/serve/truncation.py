"""``truncate_prompt_tokens`` / ``truncation_side``: a prompt cut to its first or last N ids, as vLLM's
renderer cuts it (``vllm.renderers.params.TokenizeParams``).

- N = -1 is the longest prompt the context allows: ``max_model_len`` less one when the request
  names a ``max_tokens`` (room for one generated id), ``max_model_len`` otherwise;
- N above ``max_model_len`` is a 400 naming ``truncate_prompt_tokens``;
- the side is the request's, else ``left`` (keep the last N): vLLM's server loads its tokenizer with
  ``truncation_side="left"`` (``vllm.tokenizers.get_tokenizer``), whatever the model's tokenizer says.

Only where nothing is recorded: completions, and chat completions without a rollout id. Under a
rollout id a cut prompt is not the history the rollout holds (docs/data-plane.md).
"""

from __future__ import annotations

from rollout_service.serve.protocol.openai import bad_request


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
    if keep == 0:
        return []
    return ids[-keep:] if (side or DEFAULT_SIDE) == "left" else ids[:keep]
