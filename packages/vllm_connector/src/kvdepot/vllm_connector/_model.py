"""Small models and a tokenizer built locally, so tests and the demo need no downloads.

A Llama (one KV-cache group in vLLM) and a Gemma 2 (sliding-window and full-attention layers
alternate: vLLM gives it two KV-cache groups, `SlidingWindowSpec` and `FullAttentionSpec`).

The weights are random but not degenerate: with `initializer_range=0.1` greedy decoding wanders
through many tokens (with the default 0.02 it repeats one token, and a test could not tell good
KV from bad). The model is saved in fp32, where vLLM's greedy output equals the transformers
reference token for token. Building needs `transformers` and `tokenizers` (the `testing` extra).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Written last, after the weights and the tokenizer: its presence with matching parameters is what
# makes a directory "complete". Bump FORMAT when the way a model is built changes.
MARKER_FILE = "kvdepot-model.json"
FORMAT = 1

# Special tokens, in id order: ids 0..2 of the tokenizer and of the model config.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)

# The default test model: 4 layers, head size 64 (a size vLLM's CPU attention supports).
TINY_LLAMA: dict[str, int] = {
    "num_layers": 4,
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 2048,
    "max_position_embeddings": 8192,
}
# The hybrid test model: a Gemma 2 whose even layers attend to a 256-token sliding window and
# whose odd layers attend to everything (two KV-cache groups in vLLM), head size 64.
TINY_GEMMA2: dict[str, int] = {**TINY_LLAMA, "sliding_window": 256}
# Gemma 2 ties its output head to the embedding, which it scales by sqrt(hidden): with random
# weights one token's row then wins every step (greedy output repeats it). Embeddings this much
# smaller leave the attention layers in charge, and greedy output wanders.
GEMMA2_EMBED_SCALE = 0.1
# A larger model for benchmarks: prefill dominates time to first token, so a hit shows clearly.
BENCH_LLAMA: dict[str, int] = {
    "num_layers": 8,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 4,
    "vocab": 2048,
    "max_position_embeddings": 16384,
}
# The larger model's hybrid twin for benchmarks: a Gemma 2 with a 1,024-token sliding window on
# its even layers (long prompts hold it several times over).
BENCH_GEMMA2: dict[str, int] = {**BENCH_LLAMA, "sliding_window": 1024}

_SYLLABLES = [
    "ka",
    "ki",
    "ku",
    "ke",
    "ko",
    "sa",
    "si",
    "su",
    "se",
    "so",
    "ta",
    "ti",
    "tu",
    "te",
    "to",
    "na",
    "ni",
    "nu",
    "ne",
    "no",
    "ha",
    "hi",
    "hu",
    "he",
    "ho",
    "ma",
    "mi",
    "mu",
    "me",
    "mo",
    "ra",
    "ri",
    "ru",
    "re",
    "ro",
    "ya",
    "yu",
    "yo",
    "wa",
    "ga",
    "gi",
    "gu",
    "ge",
    "go",
    "za",
    "zi",
    "zu",
    "ze",
    "zo",
    "da",
    "de",
    "do",
    "ba",
    "bi",
    "bu",
    "be",
    "bo",
    "pa",
    "pi",
    "pu",
    "pe",
    "po",
    "an",
    "in",
    "un",
    "en",
    "on",
    "ar",
    "ir",
    "ur",
    "er",
    "or",
    "al",
    "il",
    "ul",
    "el",
    "ol",
    "str",
    "pl",
    "tr",
    "kr",
    "bl",
    "gr",
]


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Pseudo-text with enough distinct pairs for a byte-level BPE to reach a few thousand merges."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    punctuation = [".", ",", "!", "?", ";", ":"]
    lines = []
    for _ in range(num_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
        lines.append(line.capitalize() + rng.choice(punctuation) + " " + str(rng.randint(0, 9999)))
    return lines


def _model_params(
    *,
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seed: int,
    max_position_embeddings: int,
    intermediate: int | None,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    extra = {"architecture": "gemma2", "sliding_window": sliding_window} if sliding_window else {}
    return {
        **extra,
        "format": FORMAT,
        "num_layers": num_layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "vocab": vocab,
        "seed": seed,
        "max_position_embeddings": max_position_embeddings,
        "intermediate": intermediate if intermediate is not None else 2 * hidden,
    }


def is_complete(path: str | os.PathLike[str], params: dict[str, Any] | None = None) -> bool:
    """Whether `path` holds a finished model (built with `params`, when given)."""
    marker = Path(path) / MARKER_FILE
    try:
        stored = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return params is None or stored.get("params") == params


def _write_tokenizer(directory: Path, vocab: int, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        model_max_length=1 << 20,
    )
    fast.save_pretrained(directory)
    return int(tokenizer.get_vocab_size())


def _write_model(directory: Path, params: dict[str, Any]) -> None:
    import torch
    import transformers

    common = {
        "vocab_size": params["vocab"],
        "hidden_size": params["hidden"],
        "intermediate_size": params["intermediate"],
        "num_hidden_layers": params["num_layers"],
        "num_attention_heads": params["heads"],
        "num_key_value_heads": params["kv_heads"],
        "max_position_embeddings": params["max_position_embeddings"],
        "initializer_range": 0.1,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "dtype": "float32",
    }
    if params.get("architecture") == "gemma2":
        head_dim = params["hidden"] // params["heads"]
        config: Any = transformers.Gemma2Config(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=params["sliding_window"],
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(params["num_layers"])],
        )
        model_cls: Any = transformers.Gemma2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model_cls = transformers.LlamaForCausalLM
    # Seed the global generator: transformers initialises weights through it.
    state = torch.random.get_rng_state()
    torch.manual_seed(params["seed"])
    try:
        model = model_cls(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(state)
    if params.get("architecture") == "gemma2":
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(GEMMA2_EMBED_SCALE)
    model.save_pretrained(directory, safe_serialization=True)


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 2048,
    seed: int = 0,
    max_position_embeddings: int = 8192,
    intermediate: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Build (or reuse) a random fp32 Llama model and a byte-level BPE tokenizer in `path`.

    With `sliding_window`, the model is a Gemma 2 instead: its even layers attend to that many
    tokens, its odd layers to all of them (vLLM gives it two KV-cache groups).

    Idempotent: a directory that already holds a complete model with the same parameters is
    returned untouched; one with other parameters or a half-written one is rebuilt. The build
    happens in a sibling temporary directory that is renamed into place, so concurrent builders
    never see a partial model. Returns `path` as a `Path`.
    """
    target = Path(path)
    params = _model_params(
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
        intermediate=intermediate,
        sliding_window=sliding_window,
    )
    if is_complete(target, params):
        return target
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads}), and heads of kv_heads ({kv_heads})")

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer_vocab = _write_tokenizer(staging, vocab, seed)
        _write_model(staging, params)
        marker = {"params": params, "tokenizer_vocab": tokenizer_vocab}
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if target.exists():
            if is_complete(target, params):
                return target  # another builder won the race
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not is_complete(target, params):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def tokenizer_vocab_size(path: str | os.PathLike[str]) -> int:
    """The number of token ids the model's tokenizer knows; prompts must use ids below it."""
    stored = json.loads((Path(path) / MARKER_FILE).read_text())
    return int(stored["tokenizer_vocab"])
