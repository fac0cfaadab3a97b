"""A generation cut without the end-of-turn token (max_tokens, stop string): the tail closes the
turn exactly as the template would, and the generated ids stay as generated."""

import pytest

from onpolicy_fixtures import IM_END, Rollout, decode, encode, template


@pytest.mark.parametrize("gen_text", ["Half a sente", "ends with newline\n", "trailing space "])
def test_tail_closes_the_turn_like_the_template(gen_text):
    gen = encode(gen_text)
    r = Rollout(template("ours"))
    r.messages = [{"role": "user", "content": "Go."}]
    first = r.call(gen, finish_reason="length")
    r.messages.append({"role": "user", "content": "Continue."})
    second = r.call(encode("ok") + [IM_END])
    tail = decode(second.plan.added_prompt_ids)
    assert tail == "<|im_end|>\n<|im_start|>user\nContinue.<|im_end|>\n<|im_start|>assistant\n"
    assert second.plan.prompt_ids == first.plan.prompt_ids + gen + second.plan.added_prompt_ids
    # The template's own rendering of the same turn: content, then exactly this tail.
    full = r.tmpl.render(
        [{"role": "user", "content": "Go."}, {"role": "assistant", "content": gen_text}, {"role": "user", "content": "Continue."}],
        tools=None, add_generation_prompt=True,
    )
    assert full.endswith(gen_text + tail)


def test_emitted_end_of_turn_is_not_repeated():
    r = Rollout(template("ours"))
    r.messages = [{"role": "user", "content": "Go."}]
    r.call(encode("Done.") + [IM_END])
    r.messages.append({"role": "user", "content": "Next."})
    second = r.call(encode("ok") + [IM_END])
    assert decode(second.plan.added_prompt_ids) == "\n<|im_start|>user\nNext.<|im_end|>\n<|im_start|>assistant\n"


def test_other_special_stop_token_gets_the_template_closing():
    """<|endoftext|> is an eos of the model but not this template's turn end: the turn is still closed."""
    r = Rollout(template("ours"))
    r.messages = [{"role": "user", "content": "Go."}]
    r.call(encode("Done.") + [151643])
    r.messages.append({"role": "user", "content": "Next."})
    second = r.call(encode("ok") + [IM_END])
    assert decode(second.plan.added_prompt_ids).startswith("<|im_end|>\n<|im_start|>user")
