"""``rollout-service`` command line: build-tiny-model, up, demo."""

from __future__ import annotations

import argparse
import sys


def _cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from rollout_service.tiny_model import build_tiny_model

    path = build_tiny_model(args.dir, seed=args.seed, overwrite=args.overwrite)
    print(path)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from rollout_service.serve.launcher import run_up

    return run_up(host=args.host, port=args.port, config_path=args.config, redis_url=args.redis_url)


def _cmd_demo(args: argparse.Namespace) -> int:
    from rollout_service.demo import run_demo

    return run_demo(base_url=args.url, turns=args.turns, api_key=args.api_key)


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
    u.set_defaults(func=_cmd_up)

    d = sub.add_parser("demo", help="drive a multi-turn tool-using rollout against a running service")
    d.add_argument("--url", default="http://127.0.0.1:8000")
    d.add_argument("--turns", type=int, default=4)
    d.add_argument("--api-key", default=None)
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    from rollout_service.runtime import apply_ray_env

    apply_ray_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
