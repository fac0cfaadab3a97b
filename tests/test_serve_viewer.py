"""The trajectory viewer: one self-contained page per rollout, every token one element.

The page is rendered from the stored state (pure tests, a fake tokenizer that decodes to hostile
HTML) and loaded from the running service in Debian's headless ``chromium`` (installed by
``scripts/setup_test_clients.sh``): the DOM the browser built must hold exactly the trajectory's tokens, in order,
with exactly its loss-masked ones marked generated and their logprobs on hover.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import uuid
from html.parser import HTMLParser

import pytest

from serve_helpers import MODEL

from rollout_service.onpolicy.types import RolloutState, Segment, TurnRecord, WeightSpan
from rollout_service.onpolicy.trajectory import trajectory_export
from rollout_service.serve.viewer import render_trajectory_html
from synthetic_rollouts import synthetic_rollout


class PageTokens(HTMLParser):
    """Token elements of a viewer page, per segment: (classes, title, text) in document order."""

    def __init__(self, page: str):
        super().__init__()
        self.segments: list[list[tuple[set[str], str, str]]] = []
        self.forks: list[int] = []
        self.legend: list[str] = []
        self.scripts = 0
        self._open: list[str] = []  # what the text currently goes to: "tok", "key" or ""
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        if tag in ("script", "iframe", "object", "img", "link"):
            self.scripts += 1
        if tag == "section" and "segment" in classes:
            self.segments.append([])
            if "fork" in classes:
                self.forks.append(int(a["data-segment"]))
        if tag == "span" and "tok" in classes:
            self.segments[-1].append((classes, a.get("title") or "", ""))
            self._open.append("tok")
        elif tag == "span" and "key" in classes:
            self.legend.append("")
            self._open.append("key")
        elif tag == "span":
            self._open.append("")

    def handle_endtag(self, tag):
        if tag == "span" and self._open:
            self._open.pop()

    def handle_data(self, data):
        if "tok" in self._open:
            classes, title, text = self.segments[-1][-1]
            self.segments[-1][-1] = (classes, title, text + data)
        elif self._open and self._open[-1] == "key":
            self.legend[-1] += data


def _ids(tokens) -> list[int]:
    return [int(re.search(r"\bid (\d+)", title).group(1)) for _, title, _ in tokens]


class FakeTokenizer:
    """Decodes every id to text a careless page would execute or mangle."""

    all_special_ids = [1]

    def decode(self, ids):
        (i,) = ids
        return {0: "<script>alert('x')</script>", 1: "<|im_end|>", 2: " \n\t\"'&"}[i % 3]


# ---------------------------------------------------------------------------------------- pure
def test_every_token_is_one_element_and_generated_ones_are_the_loss_mask():
    _, state = synthetic_rollout(random.Random(3), [3, 2], prompt_tokens=9, gen_tokens=7)
    state.rollout_id = "r-1"
    page = PageTokens(render_trajectory_html(state, FakeTokenizer()))
    assert len(page.segments) == 2 and page.forks == [1]
    for seg, tokens in zip(state.segments, page.segments):
        assert _ids(tokens) == seg.token_ids
        assert [int("gen" in c) for c, _, _ in tokens] == seg.loss_mask


def test_token_text_is_escaped_and_the_page_loads_and_runs_nothing():
    _, state = synthetic_rollout(random.Random(4), [2], prompt_tokens=6, gen_tokens=6)
    state.rollout_id = "r-2"
    state.segments[0].turns[0].finish_reason = "<img src=x onerror=alert(1)>"
    state.segments[0].turns[0].weight_versions[0].version = "</style><script>alert(2)</script>"
    html = render_trajectory_html(state, FakeTokenizer())
    assert "<script" not in html.lower() and "<img" not in html.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    page = PageTokens(html)
    assert page.scripts == 0
    texts = [t for _, _, t in page.segments[0]]
    assert "<script>alert('x')</script>" in texts  # the browser shows the text as text
    assert "\u00b7\u21b5\u2192\"'&" in texts  # space, newline, tab made visible


def test_generated_tokens_carry_their_logprob_and_a_colour_per_weight_version():
    ids = [10, 11, 12, 13, 14, 15, 16]
    seg = Segment(ids, [0, 0, 0, 1, 1, 1, 1], [0.0, 0.0, 0.0, -0.25, -1.5, -0.125, -2.0],
                  [TurnRecord(1, 0, 3, 7, "length", True, [WeightSpan("7", 3, 5), WeightSpan("8", 5, 7)])],
                  [{"role": "user", "content": "hi"}])
    html = render_trajectory_html(RolloutState("r-3", 1, [seg]), FakeTokenizer())
    page = PageTokens(html)
    gen = [(c, t) for c, t, _ in page.segments[0] if "gen" in c]
    assert [re.search(r"logprob (-?[\d.]+)", t).group(1) for _, t in gen] == ["-0.250000", "-1.500000", "-0.125000",
                                                                             "-2.000000"]
    assert [re.search(r"version (\S+)", t).group(1) for _, t in gen] == ["7", "7", "8", "8"]
    assert [c & {"v0", "v1"} for c, _ in gen] == [{"v0"}, {"v0"}, {"v1"}, {"v1"}]
    assert page.legend[1:] == ["generated · version 7", "generated · version 8"]
    assert "finish <b>length</b>" in html and "prompt [0, 3) · generated [3, 7)" in html


def test_a_fork_shows_the_reason_derived_from_the_stored_messages():
    def seg(messages, monotonic, turn):
        return Segment([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [TurnRecord(turn, 0, 1, 3, "stop", monotonic)], messages)

    sys_, user = {"role": "system", "content": "s"}, {"role": "user", "content": "hello"}
    answer = {"role": "assistant", "content": "ok"}
    edited = seg([sys_, {"role": "user", "content": "hello, EDITED"}, answer], False, 2)
    html = render_trajectory_html(RolloutState("r-4", 2, [seg([sys_, user, answer], True, 1), edited]), FakeTokenizer())
    assert "Forked at turn 2: message 1 differs from the history the model saw (field &#x27;content&#x27;)" in html
    shorter = seg([sys_, answer], False, 2)
    html = render_trajectory_html(RolloutState("r-5", 2, [seg([sys_, user, answer], True, 1), shorter]), FakeTokenizer())
    assert "Forked at turn 2: message 1 differs" in html  # a dropped message shows where the histories part
    export = trajectory_export(RolloutState("r-6", 2, [seg([sys_, user, answer], True, 1), edited]))
    assert "Forked at turn 2: reason not recorded" in render_trajectory_html(export, FakeTokenizer())


# ---------------------------------------------------------------------------------------- browser
def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: run scripts/setup_test_clients.sh (apt-get install chromium)")
    return path


def _browser(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", *args],
        capture_output=True, text=True, timeout=180, check=True)


def _chat(http, rid: str, messages: list[dict], max_tokens: int) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                                "seed": 11},
                  headers={"X-Rollout-Id": rid})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_the_page_of_a_forked_rollout_in_a_real_browser_holds_every_token(http, service, tmp_path):
    rid = f"view-{uuid.uuid4().hex[:8]}"
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say <b>hi</b> & go"}]
    first = _chat(http, rid, history, 8)
    history += [{"role": "assistant", "content": first["content"] or ""}, {"role": "user", "content": "again"}]
    second = _chat(http, rid, history, 8)
    assert second["rollout"]["monotonic"] is True
    edited = [history[0], {"role": "user", "content": "Say hello (edited)"}, {"role": "user", "content": "go"}]
    third = _chat(http, rid, edited, 6)
    assert (third["rollout"]["segment"], third["rollout"]["monotonic"]) == (1, False)
    traj = http.get(f"/v1/rollouts/{rid}").json()

    r = http.get(f"/rollouts/{rid}/view")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]

    url = f"{service.url}/rollouts/{rid}/view"
    dom = _browser(tmp_path, "--dump-dom", url).stdout
    shot = tmp_path / "viewer.png"
    _browser(tmp_path, f"--screenshot={shot}", "--window-size=1280,1600", "--hide-scrollbars", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000, "no screenshot"
    print(f"viewer screenshot: {shot}")

    page = PageTokens(dom)
    assert sum(len(s) for s in page.segments) == sum(len(s["token_ids"]) for s in traj["segments"])
    assert sum("gen" in c for s in page.segments for c, _, _ in s) == sum(sum(s["loss_mask"]) for s in traj["segments"])
    assert page.forks == [1] and len(page.segments) == 2
    for seg, tokens in zip(traj["segments"], page.segments):
        assert _ids(tokens) == seg["token_ids"]
        assert [int("gen" in c) for c, _, _ in tokens] == seg["loss_mask"]
        shown = [float(re.search(r"logprob (-?[\d.]+)", t).group(1)) for c, t, _ in tokens if "gen" in c]
        assert shown == pytest.approx([lp for lp, m in zip(seg["logprobs"], seg["loss_mask"]) if m], abs=1e-6)
    versions = {s["version"] for seg in traj["segments"] for s in seg["weight_versions"]}
    assert sorted(page.legend[1:]) == sorted(f"generated · version {v}" for v in versions)
    assert "Forked at turn 3: message 1 differs from the history the model saw (field 'content')" in dom
    assert "<b>hi</b>" in "".join(t for _, _, t in page.segments[0])  # the user's markup is shown as text


def test_the_viewer_answers_404_for_an_unknown_rollout_and_400_for_an_invalid_id(http):
    r = http.get(f"/rollouts/nope-{uuid.uuid4().hex[:8]}/view")
    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"
    r = http.get("/rollouts/bad*id/view")
    assert r.status_code == 400 and r.json()["error"]["param"] == "rollout_id"


def test_a_constrained_turn_is_marked_and_a_free_one_is_not():
    ids = [10, 11, 12, 13, 14, 15]
    forced = TurnRecord(1, 0, 2, 3, "tool_calls", True, [WeightSpan("0", 2, 3)])
    forced.constrained = True
    free = TurnRecord(2, 3, 5, 6, "length", True, [WeightSpan("0", 5, 6)])
    seg = Segment(ids, [0, 0, 1, 0, 0, 1], [0.0, 0.0, -0.5, 0.0, 0.0, -1.0], [forced, free],
                  [{"role": "user", "content": "hi"}])
    html = render_trajectory_html(RolloutState("r-c", 2, [seg]), FakeTokenizer())
    assert re.findall(r'data-turn="(\d+)" data-constrained="(\w+)"', html) == [("1", "true"), ("2", "false")]
    assert html.count(">constrained</span>") == 1


def test_the_rollout_index_lists_the_newest_rollouts_and_its_links_resolve_in_a_browser(http, service, tmp_path):
    """GET /v1/rollouts (ids for tools, a page at a time) and GET /rollouts (the page for people): the
    rollouts just run come first with their turns, segments and markers; every link on the page,
    as headless chromium renders it, answers."""
    plain, forked = f"index-{uuid.uuid4().hex[:8]}", f"index-{uuid.uuid4().hex[:8]}"
    history = [{"role": "user", "content": "hi"}]
    _chat(http, plain, history, 4)
    first = _chat(http, forked, history, 4)
    _chat(http, forked, history + [{"role": "assistant", "content": first["content"] or ""},
                                   {"role": "user", "content": "more"}], 4)
    _chat(http, forked, [{"role": "user", "content": "edited"}], 4)
    listing = http.get("/v1/rollouts", params={"limit": 2})
    assert listing.status_code == 200, listing.text
    page = listing.json()
    assert [r["id"] for r in page["data"]] == [forked, plain] and page["has_more"] in (True, False)
    top = page["data"][0]
    assert (top["turns"], top["segments"], top["forked"], top["migrations"]) == (3, 2, True, 0)
    assert top["weight_version"] and page["data"][1]["forked"] is False
    if page["next_cursor"]:
        older = http.get("/v1/rollouts", params={"limit": 2, "cursor": page["next_cursor"]}).json()
        assert not {r["id"] for r in older["data"]} & {forked, plain}
    for bad in ({"limit": 0}, {"limit": 5000}, {"cursor": "nonsense"}, {"limit": "x"}):
        r = http.get("/v1/rollouts", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("limit", "cursor", "query.limit"), (bad, r.text)

    r = http.get("/rollouts", params={"limit": 5})
    assert r.status_code == 200 and "default-src 'none'" in r.headers["content-security-policy"]
    dom = _browser(tmp_path, "--dump-dom", f"{service.url}/rollouts?limit=5").stdout
    assert "Recent rollouts" in dom and "forked (1)" in dom
    links = re.findall(r'href="([^"]+)"', dom)
    assert f"/rollouts/{forked}/view" in links and f"/v1/rollouts/{plain}" in links
    for link in links:
        target = http.get(link.replace("&amp;", "&"))
        assert target.status_code == 200, (link, target.text[:200])
