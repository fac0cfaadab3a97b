"""Several choices in one call, as vLLM's server answers them: ``n > 1`` (chat completions and
completions) and several prompts in one completions request.

vLLM's engine turns ``n`` into ``n`` child requests (the child ``j`` sampled with ``seed + j`` when
the call has a seed) and a list of prompts into one request per prompt; the server merges their
outputs: choice ``index = prompt * n + j``, usage with each prompt counted once and the generated
tokens summed, streamed chunks interleaved in the order they come (each naming its choice), one
usage chunk at the end. Here each choice is one ordinary call of the turn runner, answered by its
dialect as a one-choice answer, and the answers are merged the same way.

Under a rollout id ``R`` (chat completions), ``n > 1`` opens a group: choice ``j`` is the first call
of rollout ``R/j`` (:func:`group_turns`), the members form the group ``R`` (or the one
``X-Rollout-Group`` names) and start on one engine, the group's home. Each member is then a
rollout like any other: its own turns, replay, migration and canary draws.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any, AsyncIterator

from rollout_service.serve.protocol.envelope import bad_request
from rollout_service.serve.turn_types import TurnRequest
from rollout_service.store.base import ROLLOUT_ID_MAX_LEN

DONE = b"data: [DONE]\n\n"


def child_sampling(sampling: dict[str, Any], j: int) -> dict[str, Any]:
    """Sample ``j``'s parameters: n = 1 and, with a seed, vLLM's child seed ``seed + j``."""
    child = {k: v for k, v in sampling.items() if k != "n"}
    if child.get("seed") not in (None, -1):  # -1 is vLLM's "no seed": every child unseeded
        child["seed"] = child["seed"] + j
    return child


def merge_answers(bodies: list[dict[str, Any]], prompt_of: list[int]) -> dict[str, Any]:
    """One-choice answers (JSON dicts, in choice order) as one: the first's envelope, every choice
    with its index, the usage summed with each prompt counted once (``prompt_of``: each choice's prompt)."""
    merged = dict(bodies[0])
    merged["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    if merged.get("usage") is not None:
        merged["usage"] = summed_usage([b.get("usage") or {} for b in bodies], prompt_of)
    return merged


def summed_usage(usages: list[dict[str, Any]], prompt_of: list[int]) -> dict[str, Any]:
    """vLLM's usage of several choices: each prompt's tokens once, the generated tokens of all."""
    firsts = {p: i for i, p in reversed(list(enumerate(prompt_of)))}
    prompt = sum(usages[i].get("prompt_tokens", 0) for i in firsts.values())
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    out = dict(usages[0])
    out.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    details = [u.get("completion_tokens_details") for u in usages]
    if any(details):
        out["completion_tokens_details"] = {"reasoning_tokens": sum((d or {}).get("reasoning_tokens") or 0 for d in details)}
    return out


async def merged_stream(streams: list[AsyncIterator[bytes]], prompt_of: list[int],
                        include_usage: bool, firsts_in_order: bool = False) -> AsyncIterator[bytes]:
    """SSE frames of several one-choice streams as one stream: every chunk re-indexed to its choice
    and under one id; with ``firsts_in_order`` (chat) each choice's first chunk, its role chunk, in
    choice order before any other, as vLLM sends them, then the rest interleaved as they come; their usage chunks and
    ``[DONE]`` replaced by one summed usage chunk (if asked) and one ``[DONE]``. An error event of any
    choice ends the stream."""
    cid = None
    queue: asyncio.Queue = asyncio.Queue()
    usages: list[dict[str, Any] | None] = [None] * len(streams)
    template: dict[str, Any] | None = None

    async def pump(i: int, frames: AsyncIterator[bytes]) -> None:
        try:
            async for frame in frames:
                await queue.put((i, frame))
        except Exception as exc:  # the dialect's stream turns call errors into error events; this is a bug
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    async def arrivals() -> AsyncIterator[tuple[int, Any]]:
        """(choice, frame) as they come; with ``firsts_in_order``, the choices' first data frames come
        first, in choice order (a chat answer's role chunks: every choice's first event is in before
        this stream starts, so that costs no wait), unless an error arrives first: it ends the wait."""
        first: dict[int, Any] = {}
        held: list[tuple[int, Any]] = []
        ended: set[int] = set()
        while firsts_in_order and len(first) + len(ended - set(first)) < len(streams):
            i, frame = await queue.get()
            if frame is None:
                ended.add(i)
            if isinstance(frame, Exception) or _is_error_event(frame):
                held.append((i, frame))
                break
            if i in first or i in ended or not frame.startswith(b"data: ") or frame == DONE:
                held.append((i, frame))
            else:
                first[i] = frame
        for i in sorted(first):
            yield i, first[i]
        for item in held:
            yield item
        while True:
            yield await queue.get()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    incoming = arrivals()
    try:
        while open_streams:
            i, frame = await incoming.__anext__()
            if frame is None:
                open_streams -= 1
                continue
            if isinstance(frame, Exception):
                raise frame
            if not frame.startswith(b"data: ") or frame == DONE:
                continue
            chunk = json.loads(frame[6:])
            if "error" in chunk and "choices" not in chunk:
                yield frame
                yield DONE
                return
            if not chunk.get("choices") and chunk.get("usage") is not None:
                usages[i] = chunk["usage"]
                template = template or chunk
                continue
            if "id" in chunk:  # (the token route's chunks carry a request_id instead, the same in every choice)
                cid = cid or chunk["id"] or uuid.uuid4().hex
                chunk["id"] = cid
            for choice in chunk.get("choices", []):
                choice["index"] = i
            yield b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        if include_usage and template is not None:
            # (a choice whose stream ended without its usage chunk, e.g. a lost engine, adds nothing)
            came = [(u, p) for u, p in zip(usages, prompt_of) if u is not None]
            template = {**template, **({"id": cid} if cid is not None else {}),
                        "usage": summed_usage([u for u, _ in came], [p for _, p in came])}
            yield b"data: " + json.dumps(template, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        yield DONE
    finally:
        await incoming.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _is_error_event(frame: bytes | None) -> bool:
    """An SSE error event (``data: {"error": ...}``, no choices): the stream's end."""
    if not frame or not frame.startswith(b"data: {") or b'"error"' not in frame:
        return False
    chunk = json.loads(frame[6:])
    return "error" in chunk and "choices" not in chunk


MAX_CHOICES = 1024  # choices (prompts x n) of one call: each is one engine request


def check_n(n: int | None, max_n: int, prompts: int = 1, param: str = "n") -> int:
    """The call's ``n`` (1 when unset); 400 outside 1..max_n, or when prompts x n exceeds MAX_CHOICES."""
    n = 1 if n is None else n
    if not 1 <= n <= max_n:
        raise bad_request(f"{param} must be in [1, {max_n}] (service.max_n), got {n}", param=param)
    if prompts * n > MAX_CHOICES:
        raise bad_request(f"{prompts} prompts x n={n} is {prompts * n} choices; at most {MAX_CHOICES} per call",
                          param=param)
    return n


def member_id(rollout_id: str, j: int) -> str:
    """The rollout of choice ``j`` of a call with ``n > 1`` under ``rollout_id``."""
    return f"{rollout_id}/{j}"


def group_turns(turn: TurnRequest, n: int) -> list[TurnRequest]:
    """The first calls of the group a call with ``n > 1`` opens under its rollout id ``R``: choice
    ``j`` is rollout ``R/j`` with vLLM's child sampling, all of the group ``R`` (or X-Rollout-Group's)
    and placed together. 400 (X-Rollout-Id) when ``R/{n-1}`` would be longer than a rollout id may be."""
    assert turn.rollout_id is not None
    last = member_id(turn.rollout_id, n - 1)
    if len(last) > ROLLOUT_ID_MAX_LEN:
        raise bad_request(f"with n={n} the rollout id may be at most {ROLLOUT_ID_MAX_LEN - len(last) + len(turn.rollout_id)} "
                          f"characters: its members are {turn.rollout_id}/0 ... {last} (at most {ROLLOUT_ID_MAX_LEN})",
                          param="X-Rollout-Id", code="invalid_rollout_id")
    group = turn.rollout_group or turn.rollout_id
    return [dataclasses.replace(turn, rollout_id=member_id(turn.rollout_id, j), rollout_group=group, group_together=True,
                                sampling=child_sampling(turn.sampling, j)) for j in range(n)]
