"""Tiny, random, locally built LLMs that ``mlx_lm.load(path)`` accepts (no network).

Test and benchmark scaffolding, not part of the shipped package: the tests import it through
pytest's ``pythonpath`` (``tools/builders``, pyproject.toml), the scripts in ``tools/builders/`` as a sibling
module and the benchmarks through ``tools/bench/bench_common.py`` (tools/README.md); :mod:`tiny_tasks` holds the
synthetic task data and ``tools/builders/make_tiny_model.py`` combines both for ``recipes/tiny_sentiment.yaml``.

``make_tiny_model(tmp_dir, arch)`` trains a small BPE tokenizer with the
``tokenizers`` library on a built-in corpus (movie-review / fact-check
sentences and their JSON answers such as ``{"sentiment": "positive"}`` and
``{"correctness": true}``), writes ``tokenizer.json`` + ``tokenizer_config.json``
(with a Phi-3-style chat template and the special tokens ``<|system|>``,
``<|user|>``, ``<|assistant|>``, ``<|end|>``, ``<|endoftext|>``), builds a
random mlx-lm model of the requested architecture from a config dict and saves
``config.json`` + ``model.safetensors`` in the mlx-lm directory layout.

Architectures (the SDM-network code must handle tied and untied heads):

=======  ==================  =============================================  =========
arch     tokenizer           model                                          lm_head
=======  ==================  =============================================  =========
phi3     SentencePiece-like  ``mlx_lm.models.phi3`` (Phi-3/3.5 layout)      untied
         (Metaspace ``▁``,
         byte fallback)
qwen2    byte-level BPE      ``mlx_lm.models.qwen2`` (q/k/v biases, GQA)    **tied**
llama    byte-level BPE,     ``mlx_lm.models.llama`` (GQA)                  untied
         BOS ``<s>`` added
         by the tokenizer
=======  ==================  =============================================  =========

Everything is deterministic for a given ``seed``.  Building one model takes
well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHS = ("phi3", "qwen2", "llama", "gemma3_text")

SPECIAL_TOKENS = ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

#: Phi-3(.5)-mini-instruct's chat template (own transcription of its behaviour).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

_REVIEWS = [
    "A warm and funny film with a wonderful cast.",
    "The plot is dull and the acting is wooden.",
    "I loved every minute of this movie!",
    "Boring, too long, and badly written.",
    "An instant classic: moving, sharp and beautifully shot.",
    "The worst film I have seen this year.",
]
_FACTS = [
    "Water boils at 100 degrees Celsius at sea level.",
    "The sun orbits the earth once a day.",
    "Paris is the capital of France.",
    "Spiders are insects with six legs.",
]


def corpus() -> list[str]:
    """The built-in training corpus (prompts, documents and JSON answers)."""
    lines = []
    for r in _REVIEWS:
        lines.append(
            "Classify the sentiment of the following movie review. "
            'Respond using the following JSON: {"sentiment": str}. REVIEW: ' + r
        )
    for f in _FACTS:
        lines.append(
            "Check the following document for hallucinations and/or factual inaccuracies. "
            'Respond using the following JSON: {"correctness": bool}. DOCUMENT: ' + f
        )
    answers = [
        '{"sentiment": "positive"}',
        '{"sentiment": "negative"}',
        '{"correctness": true}',
        '{"correctness": false}',
        '{"answer_letter": "A", "confidence_in_answer_letter": 0.9}',
    ]
    lines += answers * 8
    lines += ["You are a helpful AI assistant.", "Hello, world! 0123456789 {}[]():;,.?-_'\"/"]
    return lines


def _byte_level_tokenizer(vocab_size: int, add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _spm_like_tokenizer(vocab_size: int):
    """A Llama/Phi-3-style tokenizer: ``▁`` word marker, byte-fallback tokens ``<0xNN>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Pieces: an optional ``▁`` then a run of letters/digits or a run of other symbols,
    # so ``"}`` stays its own piece (as token 9092 in Phi-3's vocabulary).
    probe = Tokenizer(models.BPE(unk_token="<unk>"))
    probe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    probe.pre_tokenizer = pre_tokenizers.Split(
        Regex("▁?[A-Za-z0-9]+|▁?[^A-Za-z0-9▁]+|▁"), behavior="isolated"
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    probe.train_from_iterator(corpus(), trainer=trainer)
    trained = json.loads(probe.to_str())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(trained["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["model"]["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = probe.normalizer
    tok.pre_tokenizer = probe.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def _tokenizer_for(arch: str):
    from tokenizers import AddedToken

    if arch == "phi3":
        tok = _spm_like_tokenizer(360)
    else:
        tok = _byte_level_tokenizer(420, add_bos=(arch == "llama"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _model_config(arch: str, vocab_size: int, eos_id: int, bos_id: int) -> dict:
    base = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "eos_token_id": eos_id,
        "bos_token_id": bos_id,
        "pad_token_id": eos_id,
    }
    if arch == "phi3":
        base.update(num_key_value_heads=4, tie_word_embeddings=False)
    elif arch == "qwen2":
        base.update(num_key_value_heads=2, tie_word_embeddings=True)
    elif arch == "llama":
        base.update(num_key_value_heads=2, tie_word_embeddings=False)
    elif arch == "gemma3_text":  # its own cache types (make_cache): a 6-token sliding window on every other layer
        base.update(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                    sliding_window_pattern=2, rope_local_base_freq=10000.0)
    return base


def make_tiny_model(tmp_dir, arch: str = "phi3", seed: int = 0, overrides: dict | None = None) -> str:
    """Write a tiny random ``arch`` model + tokenizer under ``tmp_dir/tiny-<arch>-<seed>``; return the path.

    The directory loads with ``mlx_lm.load(path)``.  Hidden size 64, 2 layers,
    4 heads; vocabulary = the trained tokenizer's size (a few hundred).
    ``overrides`` replaces config entries (e.g. ``{"hidden_size": 1024,
    "num_hidden_layers": 8, "vocab_size": 32064}`` for benchmarks; a larger
    ``vocab_size`` only adds unused rows); the directory name then gets a
    ``-custom`` suffix.
    """
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    path = Path(tmp_dir) / (f"tiny-{arch}-{seed}" + ("-custom" if overrides else ""))
    path.mkdir(parents=True, exist_ok=True)

    tok = _tokenizer_for(arch)
    tok.save(str(path / "tokenizer.json"))
    eos_id, bos_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<s>")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    (path / "special_tokens_map.json").write_text(
        json.dumps({k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2),
        encoding="utf-8",
    )

    config = _model_config(arch, tok.get_vocab_size(with_added_tokens=True), eos_id, bos_id)
    if overrides:
        config.update(overrides)
        if config["vocab_size"] < tok.get_vocab_size(with_added_tokens=True):
            raise ValueError("vocab_size override is smaller than the tokenizer's vocabulary")
    arch_module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = arch_module.Model(arch_module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    # Give the RMSNorm gains some spread so hidden states are not trivially scaled copies.
    for k, v in params.items():
        if k.endswith("norm.weight"):
            params[k] = 1.0 + 0.1 * mx.random.normal(v.shape)
    mx.eval(params)
    mx.save_safetensors(str(path / "model.safetensors"), params, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return str(path)
