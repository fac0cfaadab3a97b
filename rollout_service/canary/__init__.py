"""The online parity canary: a sample of finished generations re-scored by teacher forcing on an
engine at the same weight version and compared with the logprobs they were sampled with, per engine
and weight version (docs/canary.md). :mod:`~rollout_service.canary.recompute` replays vLLM's
processed logprobs from raw scores; :mod:`~rollout_service.canary.stats` keeps and merges the
figures; :mod:`~rollout_service.canary.canary` runs it in a data-plane replica."""
