"""A toy RL trainer refitting the service's weights while agent rollouts are in flight.

A ``Trainer`` Ray actor holds a :class:`~rollout_service.refit.client.TrainerClient` (so the actor
is rank 0 of the gloo weight-sync group). The actor is async, so it uses the client's awaitable
methods (``ainit_weight_sync``, ``arefit``, ``astats``): a blocking ``ray.get`` would stall its
event loop, and the agents running on it, for the whole refit. Each step it starts ``--rollouts``
agent rollouts, changes the model's weights (a random nudge standing in for an optimizer step),
refits through the controller's Ray handle while those rollouts are mid-generation, waits for
them, and prints the step's weight version, the refit report and the lag statistics (how many
refits behind the trainer each rollout's tokens are, from the per-token weight-version spans).

Agents talk to the service over HTTP (OpenAI chat completions at ``--base-url`` with an
``X-Rollout-Id`` header; the answer's message carries ``weight_versions``). With ``--direct``, or
when the endpoint does not answer, the agents drive the engine actors directly through the
controller (token ids in, token ids + spans out) — the same engines, without the Serve app.

    # against a running service (rollout-service up ...), joining its Ray cluster:
    RAY_ADDRESS=auto .venv/bin/python scripts/train_loop_example.py --steps 3
    # standalone: starts its own controller + one engine on the tiny model
    .venv/bin/python scripts/train_loop_example.py --direct --steps 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid

from rollout_service.ops.runtime import apply_local_env  # noqa: E402

apply_local_env()

import ray  # noqa: E402


def http_available(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(base_url.rstrip("/") + "/models", timeout=2).status_code == 200
    except Exception:
        return False


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, controller, model_path: str, base_url: str | None, max_tokens: int):
        from safetensors.torch import load_file

        from rollout_service.refit.client import TrainerClient

        self.client = TrainerClient(controller, timeout_s=120)
        self.controller = controller
        self.weights = load_file(os.path.join(model_path, "model.safetensors"))
        self.model_path = model_path
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.history: list[str] = []
        self.run = uuid.uuid4().hex[:4]

    async def init(self) -> dict:
        # An async actor: await refs and the client's a* methods, never ray.get (it blocks the loop).
        # Version labels are opaque strings; the trainer remembers their order to compute lag.
        self.history = [await self.controller.current_version.remote()]
        return await self.client.ainit_weight_sync()

    # -------------------------------------------------------------- agents
    async def _rollout_http(self, i: int, step: int) -> dict:
        import httpx

        rid = f"step{step}-agent{i}-{uuid.uuid4().hex[:6]}"
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": f"Agent {i}, step {step}: describe your plan."}],
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "seed": 1000 * step + i,
        }
        async with httpx.AsyncClient(base_url=self.base_url, timeout=300) as http:
            models = (await http.get("/models")).json()["data"]
            body["model"] = models[0]["id"]
            r = await http.post("/chat/completions", json=body, headers={"X-Rollout-Id": rid})
            r.raise_for_status()
            msg = r.json()["choices"][0]["message"]
        return {"spans": [tuple(s) if isinstance(s, (list, tuple)) else (s["version"], s["start"], s["end"])
                          for s in msg.get("weight_versions") or []],
                "tokens": len(msg.get("generation_token_ids") or [])}

    async def _rollout_direct(self, i: int, step: int, engines) -> dict:
        from rollout_service.engine.types import GenerateRequest
        from rollout_service.engine.sampling import SamplingOptions

        engine = engines[i % len(engines)]
        req = GenerateRequest(
            prompt_ids=[151644, 872, 198] + [1000 + (7 * i + step) % 5000 for _ in range(8)] + [151645, 198, 151644, 77091, 198],
            sampling=SamplingOptions.validated(seed=1000 * step + i, temperature=1.0, ignore_eos=True),
            max_tokens=self.max_tokens,
        )
        n, last = 0, None
        async for ref in engine.generate.options(num_returns="streaming").remote(req):
            chunk = await ref
            n += len(chunk.token_ids)
            last = chunk
        return {"spans": last.weight_versions, "tokens": n}

    # ---------------------------------------------------------------- loop
    async def step(self, step: int, rollouts: int) -> dict:
        import torch

        engines = None if self.base_url else await self.controller.get_engines.remote()
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(self._rollout_http(i, step) if self.base_url else self._rollout_direct(i, step, engines))
            for i in range(rollouts)
        ]
        await asyncio.sleep(0.5)  # let every rollout get going
        # "Optimizer step" (off the loop, like real compute): nudge the weights; then refit in flight.
        def optimizer_step(weights: dict) -> dict:
            g = torch.Generator().manual_seed(step)
            return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in weights.items()}

        self.weights = await asyncio.to_thread(optimizer_step, self.weights)
        version = f"{self.run}-step{step}"
        self.history.append(version)
        # Awaitable refit: the broadcast runs in a worker thread, the rollouts keep streaming here.
        report = await self.client.arefit(version, self.weights)
        stats = await self.client.astats()
        results = await asyncio.gather(*tasks)
        lags = []
        mixed = 0
        for r in results:
            versions = [v for v, _, _ in r["spans"]]
            mixed += len(set(versions)) > 1
            for v, s, e in r["spans"]:
                lags += [len(self.history) - 1 - self.history.index(v)] * (e - s)
        return {
            "step": step,
            "version": version,
            "rollouts": rollouts,
            "tokens": sum(r["tokens"] for r in results),
            "rollouts_spanning_refit": mixed,
            "token_lag_mean": statistics.mean(lags) if lags else 0.0,
            "token_lag_max": max(lags, default=0),
            "in_flight_at_refit": report["requests_in_flight"],
            "aborted": report["requests_aborted"],
            "refit_s": report["total_s"],
            "transfer_s": report["transfer_s"],
            "load_s": report["load_s"],
            "controller_lag_after_refit": stats["lag"],
            "wall_s": time.perf_counter() - t0,
        }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--direct", action="store_true", help="drive the engines through the controller, not HTTP")
    args = ap.parse_args(argv)

    from rollout_service.config import RolloutServiceConfig
    from rollout_service.refit.controller import RefitController, get_controller
    from rollout_service.ops.runtime import start_local_ray

    start_local_ray()
    own = fleet = None
    try:
        controller = get_controller()
        print("using the running service's refit controller")
    except ValueError:
        print("no running service: starting an engine fleet (one engine, the tiny model) and a controller")
        from rollout_service.fleet.fleet import EngineFleet

        config = RolloutServiceConfig().model_dump()
        fleet = ray.remote(EngineFleet).options(num_cpus=0, max_concurrency=1000).remote(config)
        own = controller = ray.remote(RefitController).options(num_cpus=0, max_concurrency=1000).remote(config, fleet)
    ray.get(controller.start.remote(), timeout=600)
    engines = ray.get(controller.get_engines.remote())
    model_path = ray.get(engines[0].tokenizer_path.remote())
    base_url = None if args.direct or own is not None or not http_available(args.base_url) else args.base_url
    print(f"agents: {'HTTP ' + base_url if base_url else 'direct to the engines (no HTTP endpoint)'}")

    trainer = Trainer.remote(controller, model_path, base_url, args.max_tokens)
    try:
        print("weight sync:", ray.get(trainer.init.remote(), timeout=300))
        header = f"{'step':>4} {'version':>12} {'tokens':>6} {'spanning':>8} {'lag mean':>8} {'lag max':>7} " \
                 f"{'in flight':>9} {'aborted':>7} {'refit s':>7} {'xfer s':>6} {'load s':>6}"
        print(header)
        for step in range(1, args.steps + 1):
            s = ray.get(trainer.step.remote(step, args.rollouts), timeout=600)
            print(f"{s['step']:>4} {s['version']:>12} {s['tokens']:>6} {s['rollouts_spanning_refit']:>8} "
                  f"{s['token_lag_mean']:>8.2f} {s['token_lag_max']:>7} {s['in_flight_at_refit']:>9} "
                  f"{s['aborted']:>7} {s['refit_s']:>7.3f} {s['transfer_s']:>6.3f} {s['load_s']:>6.3f}")
    finally:
        ray.kill(trainer)
        if own is not None:
            try:
                ray.get(fleet.shutdown.remote(), timeout=60)  # the fleet owns the engines
            finally:
                ray.kill(own)
                ray.kill(fleet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
