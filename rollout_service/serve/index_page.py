"""``GET /rollouts``: the most recent rollouts as one self-contained HTML page (no script, no external
resource; the viewer's policy), each linking to its view (``/rollouts/{id}/view``) and its JSON
(``/v1/rollouts/{id}``), with a link to the next, older page; ``GET /rollouts?group={id}``: a group's
members on one page."""

from __future__ import annotations

import html
import time
from typing import Any
from urllib.parse import quote

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5rem;color:#1d2433;background:#fbfbfd}
h1{font-size:1.3rem;margin:0 0 .3rem}p.summary{color:#5b6478;margin:.2rem 0 1rem}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{padding:.35rem .6rem;border-bottom:1px solid #e4e7ee;text-align:left;white-space:nowrap}
th{font-weight:600;color:#5b6478;background:#f3f5f9}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.id{font-family:ui-monospace,monospace;white-space:normal;word-break:break-all}
.mark{display:inline-block;padding:0 .4rem;margin-right:.25rem;border-radius:.6rem;font-size:.8rem}
.forked{background:#fde8d7;color:#8a3b00}.constrained{background:#e3ecfb;color:#1f4b99}
.migrated{background:#e6f4ea;color:#1e6b35}a{color:#1f4b99}nav{margin-top:1rem}
"""


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def render_index_html(rows: list[dict[str, Any]], next_cursor: str | None, limit: int, *,
                      now: float | None = None, indexed: int | None = None) -> str:
    """The page for one page of :meth:`RecentIndex.page` rows (``RolloutSummary.to_dict``)."""
    now = time.time() if now is None else now
    e = html.escape
    out = ["<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Recent rollouts</title>",
           f"<style>{_CSS}</style></head><body><h1>Recent rollouts</h1>"]
    facts = [f"{len(rows)} shown, newest first"]
    if indexed is not None:
        facts.append(f"{indexed} in the recent index")
    out.append(f"<p class=\"summary\">{e(' · '.join(facts))}</p>")
    if not rows:
        out.append("<p>No rollout on this page: none recorded yet, the ones indexed here have expired or were "
                   "deleted, or the index is off (store.recent_rollouts 0).</p>")
    else:
        out.append("<table><thead><tr><th>rollout</th><th>turns</th><th>segments</th><th>last weight version</th>"
                   "<th>markers</th><th>last turn</th><th></th></tr></thead><tbody>")
        for r in rows:
            rid = quote(r["id"], safe="")
            marks = []
            if r["forked"]:
                marks.append(f"<span class=\"mark forked\">forked ({r['segments'] - 1})</span>")
            if r["constrained_calls"]:
                marks.append(f"<span class=\"mark constrained\">constrained ({r['constrained_calls']})</span>")
            if r["migrations"]:
                marks.append(f"<span class=\"mark migrated\">migrated ({r['migrations']})</span>")
            out.append(
                f"<tr><td class=\"id\"><a href=\"/rollouts/{rid}/view\">{e(r['id'])}</a></td>"
                f"<td class=\"num\">{r['turns']}</td><td class=\"num\">{r['segments']}</td>"
                f"<td>{e(r['weight_version'] or '-')}</td><td>{''.join(marks)}</td>"
                f"<td>{e(_age(now - r['updated_at']))} ago</td>"
                f"<td><a href=\"/v1/rollouts/{rid}\">JSON</a></td></tr>")
        out.append("</tbody></table>")
    if next_cursor is not None:
        out.append(f"<nav><a rel=\"next\" href=\"/rollouts?limit={limit}&amp;cursor={quote(next_cursor, safe='')}\">"
                   "Older rollouts</a></nav>")
    out.append("</body></html>\n")
    return "".join(out)


def render_group_html(group: dict[str, Any]) -> str:
    """``GET /rollouts?group={id}``: one group's members (``GET /v1/groups/{id}``'s document) as a page,
    each with its state, turns and weight versions, linking to its view and its JSON."""
    e = html.escape
    gid = group["id"]
    counts = ", ".join(f"{n} {state}" for state, n in group["states"].items() if n)
    out = ["<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Group ",
           e(gid), f"</title><style>{_CSS}</style></head><body><h1>Group {e(gid)}</h1>",
           f"<p class=\"summary\">{group['size']} members: {e(counts)} · "
           f"<a href=\"/v1/groups/{quote(gid, safe='')}\">JSON</a> · <a href=\"/rollouts\">recent rollouts</a></p>",
           "<table><thead><tr><th>member</th><th>state</th><th>turns</th><th>first weight version</th>"
           "<th>last weight version</th><th></th></tr></thead><tbody>"]
    for m in group["members"]:
        rid = quote(m["id"], safe="")
        state = m["state"] + (f" ({m['status_reason']})" if m.get("status_reason") else "")
        link = (f"<a href=\"/rollouts/{rid}/view\">{e(m['id'])}</a>" if m["turns"] else e(m["id"]))
        out.append(f"<tr><td class=\"id\">{link}</td><td>{e(state)}</td><td class=\"num\">{m['turns']}</td>"
                   f"<td>{e(m['first_weight_version'] or '-')}</td><td>{e(m['last_weight_version'] or '-')}</td>"
                   f"<td><a href=\"/v1/rollouts/{rid}\">JSON</a></td></tr>")
    out.append("</tbody></table></body></html>\n")
    return "".join(out)
