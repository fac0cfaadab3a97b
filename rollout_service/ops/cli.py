"""``rollout-service`` command line: build-tiny-model, up, demo, status, prime-rl-admin."""

from __future__ import annotations

import argparse
import sys

from rollout_service.metrics import DEFAULT_METRICS_PORT


def _cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from rollout_service.models.tiny_model import build_tiny_model

    path = build_tiny_model(args.dir, seed=args.seed, overwrite=args.overwrite)
    print(path)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from rollout_service.ops.launcher import run_up

    return run_up(host=args.host, port=args.port, config_path=args.config, redis_url=args.redis_url,
                  metrics_port=args.metrics_port, proxy=args.proxy, verbose=args.verbose)


def _cmd_demo(args: argparse.Namespace) -> int:
    from rollout_service.ops.demo import run_demo

    return run_demo(base_url=args.url, turns=args.turns, api_key=args.api_key)


def _cmd_status(args: argparse.Namespace) -> int:
    """``GET /v1/status`` as a table (or ``--json``). Exit 0: every part read and an engine serves;
    1: degraded (a part unreadable, or no engine serving); 2: the service did not answer."""
    import json
    import os

    import httpx

    key = args.api_key or os.environ.get("ROLLOUT_SERVICE_API_KEY")
    url = args.url.rstrip("/")
    try:
        r = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {key}"} if key else {},
                      timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"rollout-service status: {url} did not answer: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if r.status_code != 200:
        print(f"rollout-service status: {url}/v1/status answered {r.status_code}: {r.text[:500]}", file=sys.stderr)
        return 2
    status = r.json()
    print(json.dumps(status, indent=2) if args.json else format_status(status, url))
    serving = [e for e in status.get("engines", []) if e.get("state") in ("healthy", "suspect")]
    return 0 if serving and not status.get("errors") else 1


def _cmd_prime_rl_admin(args: argparse.Namespace) -> int:
    import os

    from rollout_service.ops.prime_rl import run_admin

    return run_admin(service_url=args.url, host=args.host, port=args.port, ray_address=args.ray_address,
                     instance_name=args.instance_name,
                     api_key=args.api_key or os.environ.get("ROLLOUT_SERVICE_ADMIN_API_KEY")
                     or os.environ.get("ROLLOUT_SERVICE_API_KEY"),
                     service_api_key=args.service_api_key or os.environ.get("ROLLOUT_SERVICE_API_KEY"))


def format_status(status: dict, url: str) -> str:
    """The human-readable status: a header line, one row per engine, the last refit, the store."""
    import datetime

    def cell(v) -> str:
        return "-" if v is None or v == "" else str(v)

    lines = [f"rollout-service at {url}: model {cell(status.get('model'))}, weight version "
             f"{cell(status.get('weight_version'))}, fleet epoch {cell(status.get('fleet_epoch'))}"
             + (", refit running" if status.get("refitting") else "")]
    routing = status.get("routing") or {}
    if status.get("backend") or routing:
        lines.append(f"engines: {cell(status.get('backend'))} backend; routing {cell(routing.get('policy'))} "
                     f"(configured {cell(routing.get('configured'))}), {cell(routing.get('pin_moves'))} pin moves")
    header = ("ENGINE", "STATE", "VERSION", "IN FLIGHT", "GENERATION", "REPLACEMENTS", "LAST ERROR")
    rows = [tuple(cell(e.get(k)) for k in ("slot", "state", "weight_version", "in_flight", "generation",
                                            "replacements", "last_error")) for e in status.get("engines", [])]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines.append("")
    for row in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1][:80])
    if not rows:
        lines.append("(no engine)")
    lines.append("")
    last, counts = status.get("last_refit"), status.get("refits") or {}
    tally = f"{counts.get('committed', 0)} committed, {counts.get('not_committed', 0)} not committed"
    if last:
        when = last.get("ended_at") or last.get("started_at")
        at = datetime.datetime.fromtimestamp(when).isoformat(sep=" ", timespec="seconds") if when else "-"
        took = f", {last['duration_s']:.2f} s" if last.get("duration_s") is not None else ""
        if last.get("stall_s") is not None:
            took += f" (staged {last.get('staging')}, engines stalled {1e3 * last['stall_s']:.0f} ms)"
        lines.append(f"last refit: {last.get('outcome')} {cell(last.get('from_version'))} -> "
                     f"{cell(last.get('version'))} at {at}{took} ({tally} since the fleet started)")
    else:
        lines.append("last refit: none since the fleet started")
    ro = status.get("rollouts") or {}
    lines.append(f"stored rollouts: {cell(ro.get('stored'))} (key prefix {cell(ro.get('key_prefix'))})")
    dur = ro.get("durability") or {}
    if dur.get("durability") == "replicated" or dur.get("ok") is False:
        lines.append(f"store durability: {cell(dur.get('durability'))}, "
                     + (f"{cell(dur.get('in_sync'))} replica(s) in sync, {cell(dur.get('required'))} required"
                        if "required" in dur else cell(dur.get("error")))
                     + ("" if dur.get("ok") else " - appends are refused (503 store_unavailable)"))
    lines += format_canary(status.get("canary"))
    for part, err in (status.get("errors") or {}).items():
        lines.append(f"error reading {part}: {err}")
    return "\n".join(lines)


def format_canary(canary: dict | None) -> list[str]:
    """The parity canary's lines: the totals, then the latest weight version of each engine slot."""
    if not canary:
        return []

    def num(v, fmt=".2e") -> str:
        return "-" if v is None else format(v, fmt)

    skipped = canary.get("skipped") or {}
    head = (f"parity canary: {'on' if canary.get('enabled') else 'off'} (sample fraction "
            f"{canary.get('sample_fraction')}), {canary.get('checked', 0)} generations checked, "
            f"{sum(skipped.values())} skipped" + (f" ({', '.join(f'{k} {v}' for k, v in skipped.items())})" if skipped else ""))
    if not canary.get("checked"):
        return ["", head]
    lines = ["", head + f"; max |dlogprob| {num(canary.get('max_abs_diff'))}, mean {num(canary.get('mean_abs_diff'))}"]
    latest: dict[int, dict] = {}
    for e in canary.get("by_engine") or []:  # each slot's entries in the order they were last checked
        if e.get("weight_version") != "older":
            latest[e["slot"]] = e
    header = ("ENGINE", "VERSION", "CHECKED", "MAX |D|", "MEAN |D|", "MULT PROB ERR", "ABOVE THRESHOLD")
    rows = [(str(slot), str(e["weight_version"]), str(e["checked"]), num(e["max_abs_diff"]), num(e["mean_abs_diff"]),
             num(e["token_mult_prob_error"], ".6f"), num(e["share_above_threshold"], ".1%"))
            for slot, e in sorted(latest.items())]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-service", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build-tiny-model", help="write the deterministic tiny Qwen3 test model")
    b.add_argument("dir", nargs="?", default=None, help="output directory (default: user cache)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--overwrite", action="store_true")
    b.add_argument("--quiet", action="store_true", help="print only the path")
    b.set_defaults(func=_cmd_build_tiny_model)

    u = sub.add_parser("up", help="start local Ray, the engine, an embedded Redis and the app")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--config", default=None, help="YAML with a RolloutServiceConfig (default: tiny CPU model)")
    u.add_argument("--redis-url", default=None, help="use this Redis instead of the embedded one")
    u.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"Prometheus metrics at http://127.0.0.1:PORT/metrics (Ray's metrics agent; default "
                        f"{DEFAULT_METRICS_PORT}; 0: a free port Ray picks)")
    u.add_argument("--proxy", choices=["haproxy", "serve"], default="haproxy",
                   help="HTTP ingress: haproxy (default; HAProxy hashes X-Rollout-Id straight to the replica that owns "
                        "the rollout) or serve (Serve's Python HTTP proxy and consistent-hash router); "
                        "docs/data-plane.md")
    u.add_argument("--verbose", action="store_true",
                   help="print the output of Ray, the engines, the app and HAProxy here too (by default it goes to "
                        "the log directory the ready banner names)")
    u.set_defaults(func=_cmd_up)

    d = sub.add_parser("demo", help="drive a multi-turn tool-using rollout against a running service")
    d.add_argument("--url", default="http://127.0.0.1:8000")
    d.add_argument("--turns", type=int, default=4)
    d.add_argument("--api-key", default=None)
    d.set_defaults(func=_cmd_demo)

    s = sub.add_parser("status", help="engines, the last refit and stored rollouts of a running service")
    s.add_argument("--url", default="http://127.0.0.1:8000")
    s.add_argument("--json", action="store_true", help="print the GET /v1/status document")
    s.add_argument("--api-key", default=None, help="default: $ROLLOUT_SERVICE_API_KEY")
    s.add_argument("--timeout", type=float, default=60.0)
    s.set_defaults(func=_cmd_status)

    a = sub.add_parser("prime-rl-admin", help="answer prime-rl's inference admin calls (pause, update_weights, resume) "
                                              "for a running service: docs/data-plane.md")
    a.add_argument("--url", default="http://127.0.0.1:8000", help="the service (its /health and /v1/models are relayed)")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8001)
    a.add_argument("--ray-address", default=None, help="the service's Ray cluster (default: auto)")
    a.add_argument("--instance-name", default=None, help="the service's service.instance_name, if not the default")
    a.add_argument("--api-key", default=None, help="required of callers (default: $ROLLOUT_SERVICE_ADMIN_API_KEY, "
                                                   "else $ROLLOUT_SERVICE_API_KEY: prime-rl sends its client's "
                                                   "api_key_var as a bearer token here too); none: loopback only")
    a.add_argument("--service-api-key", default=None, help="for the relayed calls (default: $ROLLOUT_SERVICE_API_KEY)")
    a.set_defaults(func=_cmd_prime_rl_admin)
    return p


def main(argv: list[str] | None = None) -> int:
    from rollout_service.ops.runtime import apply_ray_env

    apply_ray_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
