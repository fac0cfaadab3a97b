"""Operations: what composes and runs the planes, not a plane itself.

``launcher`` (``rollout-service up``: Redis, Ray, the fleet, the app, the refit controller),
``runtime`` (Ray and vLLM process environment, ports, stopping what was started), ``cli``,
and ``demo`` (a multi-turn rollout through the ``openai`` SDK with the on-policy check). The
locally built test model is :mod:`rollout_service.models.tiny_model` (the configuration's default
model, so it sits below every plane).
"""
