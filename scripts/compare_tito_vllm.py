"""The token-in-token-out route against vLLM's own: the same requests to ``POST /inference/v1/generate``
of vLLM 0.32's server (``--enable-scale-out``, the tiny model, the service's engine settings) and of
the service (``up``'s LocalService), streamed and not, each with its seed. Prints, per request,
whether the generated ids are equal and the largest |logprob difference|, then a table.

    .venv/bin/python scripts/compare_tito_vllm.py [--requests 6] [--max-tokens 24]

Both servers run on this machine, one after the other (2 cores: never both generating at once);
traffic goes to 127.0.0.1 only and everything started is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

PROMPTS = [
    [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198],
    [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30,
     151645, 198, 151644, 77091, 198],
]


def requests(n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        sampling = {"max_tokens": max_tokens, "seed": 1000 + i, "logprobs": 1 + i % 3, "temperature": [1.0, 0.7, 1.3][i % 3],
                    "top_p": [1.0, 0.9, 0.95][i % 3], "ignore_eos": True}
        out.append({"token_ids": PROMPTS[i % len(PROMPTS)], "sampling_params": sampling, "stream": bool(i % 2)})
    return out


def answer(base: str, model: str, body: dict) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """(ids, logprobs, top alternatives) of one call, streamed or not."""
    import httpx

    body = {"model": model, **body}
    if not body["stream"]:
        r = httpx.post(f"{base}/inference/v1/generate", json=body, timeout=300)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        return (choice["token_ids"], [c["logprob"] for c in content],
                [[(t["token_id"], t["logprob"]) for t in c["top_logprobs"]] for c in content])
    ids, lps, tops = [], [], []
    with httpx.stream("POST", f"{base}/inference/v1/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids += choice["token_ids"]
                for c in choice["logprobs"]["content"]:
                    lps.append(c["logprob"])
                    tops.append([(t["token_id"], t["logprob"]) for t in c["top_logprobs"]])
    return ids, lps, tops


def run_all(base: str, model: str, reqs: list[dict]) -> list[tuple]:
    return [answer(base, model, body) for body in reqs]


def tito_server(engine_cfg, model: str, log_path: Path):
    """vLLM's own OpenAI server with its token-in-token-out route (``--enable-scale-out``), the
    service's engine settings; ``start()`` / ``stop()``, ``url``."""
    from bench_service_vs_vllm import VLLMServer

    server = VLLMServer(engine_cfg, model, log_path)
    server.cmd += ["--enable-scale-out"]
    return server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    from bench_service_vs_vllm import SERVED_NAME

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.ops.launcher import LocalService
    from rollout_service.ops.runtime import free_port, shutdown_local_ray

    cfg = RolloutServiceConfig()
    model = str(cfg.engine.resolved_model())
    reqs = requests(args.requests, args.max_tokens)

    log = Path(tempfile.mkdtemp(prefix="tito-vllm-")) / "vllm.log"
    vllm = tito_server(cfg.engine, model, log)
    try:
        vllm.start()
        theirs = run_all(vllm.url, SERVED_NAME, reqs)
    finally:
        vllm.stop()
    svc = LocalService(cfg, port=free_port(), log=lambda *a: None, verbose=False)
    try:
        svc.start()
        served = svc.config.engine.resolved_served_name()
        ours = run_all(svc.url, served, reqs)
    finally:
        svc.stop()
        shutdown_local_ray()
    print("| # | stream | temperature / top_p | logprobs k | tokens | ids equal | max abs logprob diff | top-k ids equal |")
    print("|---:|---|---|---:|---:|---|---:|---|")
    ok = True
    for i, (body, (ids_v, lps_v, tops_v), (ids_s, lps_s, tops_s)) in enumerate(zip(reqs, theirs, ours)):
        same = ids_v == ids_s
        diff = max((abs(a - b) for a, b in zip(lps_v, lps_s)), default=0.0) if same else float("nan")
        tops_same = [[t for t, _ in row] for row in tops_v] == [[t for t, _ in row] for row in tops_s]
        ok &= same and diff <= 1e-6
        sp = body["sampling_params"]
        print(f"| {i} | {body['stream']} | {sp['temperature']} / {sp['top_p']} | {sp['logprobs']} | {len(ids_v)} | "
              f"{same} | {diff:.2e} | {tops_same} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
