"""Problem 1 (re-tokenization): generated ids survive the next turn bit-exact, in real Qwen merges."""

import pytest

from onpolicy_fixtures import IM_END, Rollout, encode, naive_prompt_ids, template, tokenizer


def _single(text):
    ids = encode(text)
    return ids[0] if len(ids) == 1 else None


def merge_cases(limit=3):
    """(a, b, merged): ids a+b detokenize to text that re-tokenizes to the single id ``merged``."""
    found = []
    for word in [" Skinny", " hello", " tokenization", " computer", " weather", " beautiful", " understand"]:
        merged = _single(word)
        if merged is None:
            continue
        for cut in range(2, len(word) - 1):
            a, b = _single(word[:cut]), _single(word[cut:])
            if a is not None and b is not None:
                found.append((a, b, merged))
                break
        if len(found) >= limit:
            break
    return found


def resplit_cases(limit=3):
    """(x, y, canonical): a two-id split whose text re-tokenizes to a *different* id sequence."""
    found = []
    for text in [" understatement", " overstatement", " weatherman", " sunflower", " Skinny"]:
        canonical = encode(text)
        for cut in range(2, len(text) - 1):
            x, y = _single(text[:cut]), _single(text[cut:])
            if x is not None and y is not None and [x, y] != canonical:
                if len(canonical) != 1:
                    found.append((x, y, canonical))
                    break
        if len(found) >= limit:
            break
    return found


def test_real_qwen_merge_and_resplit_cases_exist():
    merges, resplits = merge_cases(), resplit_cases()
    assert len(merges) >= 2, merges
    assert len(resplits) >= 1, resplits
    tok = tokenizer()
    for a, b, merged in merges:
        assert encode(tok.decode([a, b])) == [merged] != [a, b]
    for x, y, canonical in resplits:
        assert encode(tok.decode([x, y])) == canonical != [x, y]


@pytest.mark.parametrize("case", ["merge", "resplit"])
def test_non_canonical_generation_survives_next_turn_bit_exact(case):
    if case == "merge":
        pieces = [[a, b] for a, b, _ in merge_cases()]
    else:
        pieces = [[x, y] for x, y, _ in resplit_cases()]
    gen = encode("The answer:") + [t for p in pieces for t in p] + encode(" done.") + [IM_END]
    r = Rollout(template("ours"))
    r.messages = [{"role": "user", "content": "Say something."}]
    first = r.call(gen)
    r.messages.append({"role": "user", "content": "And then?"})
    second = r.call(encode("Fine.") + [IM_END])

    p1 = first.plan.prompt_ids
    assert second.plan.prompt_ids[: len(p1) + len(gen)] == p1 + gen
    assert second.plan.monotonic and not second.plan.new_segment
    seg = r.state.segments[0]
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == gen + second.gen_ids
    # The baseline (re-render the history as text and re-tokenize it) changes the ids.
    naive = naive_prompt_ids(r.tmpl, r.messages[:-1])
    assert naive != second.plan.prompt_ids
    assert naive[: len(p1) + len(gen)] != p1 + gen
