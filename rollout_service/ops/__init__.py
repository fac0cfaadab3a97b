"""Operations: what composes and runs the planes, not a plane itself.

``launcher`` (``rollout-service up``: Redis, Ray, the fleet, the app, the refit controller),
``runtime`` (Ray and vLLM process environment, ports, stopping what was started), ``cli``,
``demo`` (a multi-turn rollout through the ``openai`` SDK with the on-policy check) and
``tiny_model`` (the locally built test model).
"""
