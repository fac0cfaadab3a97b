"""The weights wire protocol, shared by the engine's vLLM worker and the trainer.

``collective`` is the bucketed transfer over a dedicated process group (gloo on CPU, NCCL on GPU)
that the trainer's client sends with and the worker receives with; ``staging`` moves whole state
dicts between an engine actor and its worker through one safetensors file; ``worker_extension`` is
the class vLLM loads into every worker (``worker_extension_cls``), with ``worker_sources`` (where a
worker's weights come from and how they are read). Standard library only at import
time, so a trainer process can import it without vLLM or Ray.
"""
