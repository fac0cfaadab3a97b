"""The Responses stream follows OpenAI's event sequence, checked by the openai SDK's own stream reader."""

from __future__ import annotations

import uuid

import pytest

from serve_helpers import MODEL, WEATHER_TOOL


TOOL = {"type": "function", **{k: WEATHER_TOOL["function"][k] for k in ("name", "description", "parameters")}}


def _events(openai_client, rollout_id: str | None = None, **kwargs):
    """Every event, read through ``responses.stream`` (it raises on unknown items, reused indices,
    item identities that change between added and done, or a completion with unfinished items)."""
    rid = rollout_id or f"rs-{uuid.uuid4().hex[:8]}"
    with openai_client.responses.stream(model=MODEL, extra_headers={"X-Rollout-Id": rid}, **kwargs) as stream:
        return list(stream)


def _check_sequence(events):
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1
    final = events[-1].response
    items = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items) and e.item.status == "in_progress"
            items[e.output_index] = {"id": e.item.id, "type": e.item.type, "text": "", "events": []}
        else:
            item = items[e.output_index]
            item["events"].append(e.type)
            if hasattr(e, "item_id"):
                assert e.item_id == item["id"]
            if e.type.endswith(".delta"):
                item["text"] += e.delta
            if e.type in ("response.output_text.done", "response.reasoning_text.done"):
                assert e.text == item["text"]
            if e.type == "response.function_call_arguments.done":
                assert e.arguments == item["text"]
    assert [it["id"] for it in items.values()] == [o.id for o in final.output]
    for index, item in items.items():
        ev = item["events"]
        assert ev[-1] == "response.output_item.done", ev
        if item["type"] in ("message", "reasoning"):
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            assert ev[0] == "response.content_part.added" and ev[-3:] == [
                f"response.{kind}.done", "response.content_part.done", "response.output_item.done"], ev
            assert all(t == f"response.{kind}.delta" for t in ev[1:-3]), ev
            assert final.output[index].content[0].text == item["text"]
        else:
            assert ev == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done"], ev
    return final


def test_a_text_answer_cut_by_max_output_tokens_streams_items_and_ends_incomplete(openai_client):
    events = _events(openai_client, input="tell me a story", max_output_tokens=12, extra_body={"seed": 4})
    final = _check_sequence(events)
    assert events[-1].type == "response.incomplete"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    last = final.output[-1].model_dump()
    assert len(last["generation_token_ids"]) == 12 and last["rollout"]["turn"] == 1
    assert sum(e.type.endswith("text.delta") for e in events) >= 2  # the text streamed, not one final blob


def test_a_forced_tool_call_streams_a_function_call_item_and_completes(openai_client):
    events = _events(openai_client, input="weather in Paris?", tools=[TOOL], max_output_tokens=64,
                     tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 1})
    final = _check_sequence(events)
    assert events[-1].type == "response.completed" and final.status == "completed"
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.model_dump()["generation_token_ids"]


LOGPROBS = ["message.output_text.logprobs"]


def _check_logprobs(entries, ids, lps, tiny_tokenizer, top: int):
    """OpenAI's per-token entries for exactly the generation's ids and logprobs (bit-equal floats)."""
    assert [e["logprob"] for e in entries] == lps
    assert [e["token"] for e in entries] == [tiny_tokenizer.decode([i]) for i in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    for e in entries:  # the alternatives asked for, as vLLM lists them: the sampled token first, then by rank
        alts = e["top_logprobs"]
        assert len(alts) == top and all(set(a) == {"token", "logprob", "bytes"} for a in alts), e
        assert alts[0]["token"] == e["token"] and alts[0]["logprob"] == e["logprob"], e
        assert [a["logprob"] for a in alts[1:]] == sorted((a["logprob"] for a in alts[1:]), reverse=True), e


def test_responses_logprobs_on_the_output_text_are_the_generations(openai_client, tiny_tokenizer):
    """include ["message.output_text.logprobs"] with top_logprobs: the message's output_text carries
    every generated token's logprob (as vLLM's server), equal to the stored generation_log_probs."""
    r = openai_client.responses.create(model=MODEL, input="count to three", max_output_tokens=10, include=LOGPROBS,
                                       top_logprobs=2, extra_body={"seed": 3},
                                       extra_headers={"X-Rollout-Id": f"rlp-{uuid.uuid4().hex[:8]}"})
    last = r.output[-1].model_dump()
    message = next(o for o in r.output if o.type == "message").model_dump()
    _check_logprobs(message["content"][0]["logprobs"], last["generation_token_ids"], last["generation_log_probs"],
                    tiny_tokenizer, top=2)
    plain = openai_client.responses.create(model=MODEL, input="count to three", max_output_tokens=4,
                                           extra_body={"seed": 3}, extra_headers={"X-Rollout-Id": f"rlp-{uuid.uuid4().hex[:8]}"})
    assert next(o for o in plain.output if o.type == "message").content[0].logprobs == []  # not asked: none


def test_a_responses_stream_with_logprobs_carries_them_on_text_deltas_and_the_done_events(openai_client, tiny_tokenizer):
    call = dict(input="tell me a story", max_output_tokens=12, include=LOGPROBS, top_logprobs=1,
                extra_body={"seed": 4, "chat_template_kwargs": {"enable_thinking": False}})
    rid = f"rs-{uuid.uuid4().hex[:8]}"
    events = _events(openai_client, rid, **call)
    final = _check_sequence(events)
    last = final.output[-1].model_dump()
    ids, lps = last["generation_token_ids"], last["generation_log_probs"]
    done = next(e for e in events if e.type == "response.output_text.done").model_dump()
    _check_logprobs(done["logprobs"], ids, lps, tiny_tokenizer, top=1)
    message = next(o for o in final.output if o.type == "message").model_dump()
    assert message["content"][0]["logprobs"] == done["logprobs"]
    # Thinking off: every token is the message's, so the deltas carry each token once, in order (a
    # token that completes no text, such as half of a character, rides on the next text delta).
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.model_dump()["logprobs"]]
    assert [e["logprob"] for e in streamed] == lps and [e["token"] for e in streamed] == [e["token"] for e in done["logprobs"]]
    # The same call again is a retry, answered from the store: the same tokens (decoded), the same logprobs.
    again = _events(openai_client, rid, **call)
    assert _check_sequence(again).output[-1].model_dump()["rollout"]["replayed"] is True
    replayed = next(e for e in again if e.type == "response.output_text.done").model_dump()["logprobs"]
    assert [(e["token"], e["logprob"]) for e in replayed] == [(e["token"], e["logprob"]) for e in done["logprobs"]]
    streamed_again = [lp for e in again if e.type == "response.output_text.delta" for lp in e.model_dump()["logprobs"]]
    assert [(e["token"], e["logprob"]) for e in streamed_again] == [(e["token"], e["logprob"]) for e in streamed]
