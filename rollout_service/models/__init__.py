"""The model the service serves when ``engine.model`` is null: ``tiny_model``, a deterministic
tiny Qwen3 built locally on first use (random weights, the real Qwen tokenizer) for tests, demos
and benchmarks. Imports nothing else of ours: the configuration resolves its default model here.
"""
