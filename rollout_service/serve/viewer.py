"""A rollout as one self-contained HTML page (``GET /rollouts/{id}/view``) — pure rendering.

For a person debugging a rollout: what the trainer will see, token by token. Every id of every
segment is one ``<span class="tok">`` holding its own decoded text (whitespace made visible, newlines
also break the line), so the page shows the exact token boundaries rather than re-decoded text.
Generated ids (loss mask 1) carry the class ``gen`` and the colour of the weight version they were
sampled under; hovering one shows its position, id, logprob and version (the ``title``). Turns are
boxed with their boundaries and finish reason; a segment after the first is a fork, shown with the
reason re-derived from the stored messages (the same comparison the core made when it forked).

No Ray, HTTP or store imports: the page is a function of the stored state and the tokenizer, and
nothing external is loaded (inline CSS, no script), so it works offline and can be saved as a file.
Everything that comes from the rollout — token text, version labels, finish reasons — is escaped.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

from rollout_service.onpolicy.messages import first_difference
from rollout_service.onpolicy.types import RolloutState

# Distinct, light enough for dark text; cycled when a rollout spans more versions than this.
_PALETTE = ("#ffd166", "#8fd3ff", "#b8f2a0", "#f7a8d8", "#c9b6ff", "#ffb38a", "#9ff0e0", "#e6e68a",
            "#ffa3a3", "#a8c7ff")
_UNKNOWN_VERSION = "#dddddd"

_VISIBLE = {" ": "\u00b7", "\t": "\u2192", "\r": "\u240d", "\n": "\u21b5"}


@dataclass
class _Segment:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: list[dict[str, Any]]
    messages: list[dict[str, Any]] | None  # None: not available (rendered from an export)
    tools: Any = None


def render_trajectory_html(trajectory: RolloutState | dict[str, Any], tokenizer, *,
                           reasoning_policy: str = "keep", whitespace_policy: str = "edges") -> str:
    """The page for a stored rollout (a :class:`RolloutState`) or a ``trajectory_export`` document.

    ``tokenizer`` needs ``decode(list[int]) -> str``. ``reasoning_policy`` is the service's, so a
    fork's reason is derived the way the core derived it."""
    rollout_id, num_turns, segments = _normalize(trajectory)
    texts = _Decoder(tokenizer)
    versions = _versions(segments)
    out: list[str] = []
    w = out.append
    total = sum(len(s.token_ids) for s in segments)
    generated = sum(sum(s.loss_mask) for s in segments)
    gen_lps = [lp for s in segments for lp, m in zip(s.logprobs, s.loss_mask) if m]
    title = f"rollout {rollout_id}"
    w("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">")
    w(f"<title>{_e(title)}</title><style>{_css(versions)}</style></head><body>")
    w(f"<header><h1>Rollout <code>{_e(rollout_id)}</code></h1><p class=\"summary\">")
    facts = [f"{num_turns} turn{'s' if num_turns != 1 else ''}",
             f"{len(segments)} segment{'s' if len(segments) != 1 else ''} ({len(segments) - 1} fork{'s' if len(segments) != 2 else ''})",
             f"{total} tokens", f"{generated} generated"]
    if gen_lps:
        facts.append(f"mean generated logprob {sum(gen_lps) / len(gen_lps):.4f}")
    w(" · ".join(_e(f) for f in facts))
    w("</p><div class=\"legend\"><span class=\"key\">prompt / tool / template</span>")
    for label, cls in versions.items():
        w(f"<span class=\"key {cls}\">generated · version {_e(label)}</span>")
    if any(m and _version_at(s, i) is None for s in segments for i, m in enumerate(s.loss_mask)):
        w("<span class=\"key vunknown\">generated · version not recorded</span>")
    w("<span class=\"hint\">hover a token for its position, id, logprob and version "
      "(\u00b7 is a space, \u2192 a tab, \u21b5 a newline, \u2205 an empty token)</span></div></header>")
    for index, seg in enumerate(segments):
        _segment_html(w, index, seg, segments[index - 1] if index else None, texts, versions,
                      (reasoning_policy, whitespace_policy))
    w("</body></html>\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------- input
def _normalize(trajectory: RolloutState | dict[str, Any]) -> tuple[str, int, list[_Segment]]:
    if isinstance(trajectory, RolloutState):
        segments = [
            _Segment(list(s.token_ids), list(s.loss_mask), list(s.logprobs),
                     [t.to_dict(copy_answer=False) for t in s.turns], list(s.messages),
                     (s.render_context or {}).get("tools"))
            for s in trajectory.segments
        ]
        return str(trajectory.rollout_id), trajectory.turn, segments
    segments = [
        _Segment(list(s["token_ids"]), list(s["loss_mask"]), list(s["logprobs"]), list(s.get("turns", [])), None)
        for s in trajectory.get("segments", [])
    ]
    return str(trajectory.get("id")), int(trajectory.get("turns", 0)), segments


class _Decoder:
    """Each id decoded on its own (that is the token's text); cached, rollouts repeat ids a lot."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        try:
            special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
            for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
                if getattr(tok, "special", False):
                    special.add(int(i))
        except Exception:
            special = set()
        self.special = special

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _versions(segments: list[_Segment]) -> dict[str, str]:
    """Version label -> CSS class, in order of first appearance."""
    out: dict[str, str] = {}
    for seg in segments:
        for t in seg.turns:
            for span in t.get("weight_versions") or []:
                label = str(span["version"])
                if label not in out:
                    out[label] = f"v{len(out)}"
    return out


def _version_at(seg: _Segment, pos: int) -> str | None:
    for t in seg.turns:
        if t["gen_start"] <= pos < t["gen_end"]:
            for span in t.get("weight_versions") or []:
                if span["start"] <= pos < span["end"]:
                    return str(span["version"])
    return None


def _fork_reason(prev: _Segment, seg: _Segment, policies: tuple[str, str]) -> str:
    """Why the core started this segment, re-derived from the stored canonical messages: the
    previous segment's are what the model had seen, this one's begin with the forking request's."""
    if prev.messages is None or seg.messages is None:
        return "reason not recorded"
    try:
        diff = first_difference(prev.messages, seg.messages, reasoning_policy=policies[0],
                                whitespace_policy=policies[1])
    except ValueError:  # a policy this code does not know: the defaults
        diff = first_difference(prev.messages, seg.messages)
    if diff is not None:
        index, fld = diff
        if fld == "missing":
            return (f"the request had fewer messages ({len(seg.messages)}) than the {len(prev.messages)} "
                    "the model had already seen")
        return f"message {index} differs from the history the model saw (field {fld!r})"
    if prev.tools != seg.tools:
        return "the request's tools differ from those the earlier prompt was rendered with"
    n = len(prev.messages)
    if len(seg.messages) > n and seg.messages[n].get("role") == "assistant":
        return "the request added no message after the stored assistant output"
    return "reason unknown"


# ---------------------------------------------------------------------------------------- output
def _segment_html(w, index: int, seg: _Segment, prev: _Segment | None, texts: _Decoder, versions: dict[str, str],
                  policies: tuple[str, str]) -> None:
    fork = prev is not None
    w(f"<section class=\"segment{' fork' if fork else ''}\" id=\"segment-{index}\" data-segment=\"{index}\">")
    w(f"<h2>Segment {index}")
    if fork:
        w(" <span class=\"badge\">fork</span>")
    w(f" <small>{len(seg.token_ids)} tokens · {sum(seg.loss_mask)} generated · {len(seg.turns)} "
      f"turn{'s' if len(seg.turns) != 1 else ''}</small></h2>")
    if fork:
        first = seg.turns[0]["turn"] if seg.turns else "?"
        w(f"<p class=\"fork-reason\">Forked at turn {_e(first)}: {_e(_fork_reason(prev, seg, policies))}. "
          "The earlier segment is kept as it was; this one starts from the full prompt of the forking call.</p>")
    cursor = 0
    for t in sorted(seg.turns, key=lambda t: t["prompt_start"]):
        if t["prompt_start"] > cursor:
            _block(w, seg, cursor, t["prompt_start"], None, texts, versions)
        _block(w, seg, t["prompt_start"], t["gen_end"], t, texts, versions)
        cursor = max(cursor, t["gen_end"])
    if cursor < len(seg.token_ids):
        _block(w, seg, cursor, len(seg.token_ids), None, texts, versions)
    w("</section>")


def _block(w, seg: _Segment, start: int, end: int, turn: dict[str, Any] | None, texts: _Decoder,
           versions: dict[str, str]) -> None:
    if turn is None:
        w(f"<div class=\"turn untracked\"><div class=\"turn-head\">tokens [{start}, {end}) without a turn record</div>")
    else:
        spans = ", ".join(f"{_e(s['version'])} [{s['start']}, {s['end']})" for s in turn.get("weight_versions") or [])
        kind = "monotonic" if turn.get("monotonic", True) else "fork (non-monotonic)"
        constrained = bool(turn.get("constrained"))
        badge = (' · <span class="badge constrained" title="sampled under a grammar (forced tool call): its logprobs '
                 'are renormalized over the allowed tokens">constrained</span>') if constrained else ""
        w(f"<div class=\"turn{' constrained' if constrained else ''}\" data-turn=\"{_e(turn['turn'])}\""
          f" data-constrained=\"{str(constrained).lower()}\"><div class=\"turn-head\">"
          f"<b>Turn {_e(turn['turn'])}</b> · {kind} · prompt [{turn['prompt_start']}, {turn['gen_start']}) · "
          f"generated [{turn['gen_start']}, {turn['gen_end']}) · finish <b>{_e(turn.get('finish_reason'))}</b>"
          f"{' · version ' + spans if spans else ''}"
          f"{badge}</div>")
    w("<div class=\"tokens\">")
    for pos in range(start, end):
        _token(w, seg, pos, texts, versions)
    w("</div></div>")


def _token(w, seg: _Segment, pos: int, texts: _Decoder, versions: dict[str, str]) -> None:
    tid = int(seg.token_ids[pos])
    text = texts(tid)
    special = tid in texts.special
    extra = " sp" if special else ""
    if pos < len(seg.loss_mask) and seg.loss_mask[pos]:
        version = _version_at(seg, pos)
        cls = versions.get(version, "vunknown") if version is not None else "vunknown"
        lp = float(seg.logprobs[pos]) if pos < len(seg.logprobs) else float("nan")
        prob = math.exp(lp) if math.isfinite(lp) else float("nan")
        tip = f"#{pos} · id {tid} · logprob {lp:.6f} (p {prob:.4f}) · version {version if version is not None else '?'}"
        w(f"<span class=\"tok gen {cls}{extra}\" title=\"{_e(tip)}\" data-logprob=\"{lp!r}\">{_visible(text)}</span>")
    else:
        w(f"<span class=\"tok{extra}\" title=\"{_e(f'#{pos} · id {tid} · prompt')}\">{_visible(text)}</span>")


def _visible(text: str) -> str:
    """Escaped token text with whitespace shown (a newline also breaks the line)."""
    if text == "":
        return "<i class=\"ws\">\u2205</i>"
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(f"<i class=\"ws\">{_VISIBLE[ch]}</i>" + ("<br>" if ch == "\n" else ""))
        elif ord(ch) < 32 or 0x7f <= ord(ch) < 0xa0:
            out.append(f"<i class=\"ws\">\\x{ord(ch):02x}</i>")
        else:
            out.append(html.escape(ch))
    return "".join(out)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _css(versions: dict[str, str]) -> str:
    colours = "".join(f".{cls}{{background:{_PALETTE[i % len(_PALETTE)]}}}"
                      for i, cls in enumerate(versions.values()))
    return (
        "body{font:14px/1.5 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}"
        "h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.1em;margin:.2em 0}h2 small{color:#666;font-weight:normal}"
        "header{position:sticky;top:0;background:#fafafa;padding-bottom:.5em;border-bottom:1px solid #ccc;z-index:1}"
        ".summary{margin:.2em 0;color:#444}.key{margin-right:.6em;padding:0 .3em;border:1px solid #ccc;"
        "border-radius:3px;font-size:.9em}.hint{color:#777;font-size:.85em}"
        ".segment{margin:1em 0;padding:.6em;border:1px solid #bbb;border-radius:6px;background:#fff}"
        ".segment.fork{border:2px solid #d9480f}.badge{background:#d9480f;color:#fff;border-radius:4px;"
        "padding:0 .4em;font-size:.8em}.fork-reason{color:#a33a00;margin:.2em 0 .5em}"
        ".turn{margin:.5em 0;padding:.3em .5em;border-left:4px solid #5c7cfa;background:#f4f6ff}"
        ".turn.untracked{border-left-color:#999;background:#f3f3f3}.turn-head{color:#333;font-size:.85em;margin-bottom:.2em}"
        ".tokens{font:13px/1.9 ui-monospace,monospace;white-space:normal;word-break:break-all}"
        ".tok{color:#666;border-right:1px solid #e2e2e2;padding:0 1px}"
        ".tok:hover{outline:2px solid #222}.tok.sp{font-style:italic;color:#7048e8}"
        ".gen{color:#111;border-radius:2px;border-bottom:2px solid #333}"
        f".vunknown{{background:{_UNKNOWN_VERSION}}}"
        ".ws{color:#aaa;font-style:normal}"
        + colours
    )
