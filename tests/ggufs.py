"""Small .gguf files written in code: Qwen2 or Llama, their matrices in Q4_K and Q6_K
blocks (as a Q4_K_M file mixes them), norms and biases in F32, the tiny tokenizer's
vocabulary and merges, and dequantizers written from the GGML block layouts to check
the reader against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tests.tinymodels import tiny_tokenizer

QK_K = 256  # values a K-quant block holds
Q4_K_BYTES = 144  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes
Q6_K_BYTES = 210  # 128 low nibbles, 64 bytes of high bits, 16 int8 scales, d (f16)


def _f16_bytes(rng: np.random.Generator, blocks: int, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)


def random_q4_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K blocks with finite, small scales: uint8 [rows, cols / 256 * 144]."""
    blocks = rows * cols // QK_K
    raw = rng.integers(0, 256, (blocks, Q4_K_BYTES), dtype=np.uint8)
    raw[:, 0:2] = _f16_bytes(rng, blocks, 2e-4, 1e-3)  # d
    raw[:, 2:4] = _f16_bytes(rng, blocks, 2e-4, 1e-3)  # dmin
    return raw.reshape(rows, cols // QK_K * Q4_K_BYTES)


def random_q6_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    blocks = rows * cols // QK_K
    raw = rng.integers(0, 256, (blocks, Q6_K_BYTES), dtype=np.uint8)
    raw[:, 208:210] = _f16_bytes(rng, blocks, 1e-5, 6e-5)  # d
    return raw.reshape(rows, cols // QK_K * Q6_K_BYTES)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 over a column of blocks: sub-block j's 6-bit scale and min."""
    q = q.astype(np.int32)
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    return (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4), (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)


def dequantize_q4_k(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_K -> float32 [rows, cols], as ggml's dequantize_row_q4_K does it."""
    b = raw.reshape(-1, Q4_K_BYTES)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    scales, qs = b[:, 4:16], b[:, 16:144].astype(np.int32)
    out = np.empty((b.shape[0], QK_K), np.float32)
    for chunk in range(4):  # 64 values: 32 low nibbles, then 32 high nibbles of 32 bytes
        q = qs[:, 32 * chunk : 32 * chunk + 32]
        for half, codes in enumerate((q & 0xF, q >> 4)):
            sc, m = _scale_min_k4(2 * chunk + half, scales)
            lo = 64 * chunk + 32 * half
            out[:, lo : lo + 32] = (d * sc)[:, None] * codes - (dmin * m)[:, None]
    return out.reshape(rows, cols)


def dequantize_q6_k(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q6_K -> float32 [rows, cols], as ggml's dequantize_row_q6_K does it."""
    b = raw.reshape(-1, Q6_K_BYTES)
    ql, qh = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)[:, 0]
    out = np.empty((b.shape[0], QK_K), np.float32)
    for n in range(2):  # two halves of 128 values
        low, high, s = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32], sc[:, 8 * n : 8 * n + 8]
        for part in range(4):
            nib = (low[:, :32] & 0xF, low[:, 32:] & 0xF, low[:, :32] >> 4, low[:, 32:] >> 4)[part]
            q = (nib | (((high >> (2 * part)) & 3) << 4)) - 32
            for l0 in (0, 16):  # a scale per 16 values
                col = 128 * n + 32 * part + l0
                out[:, col : col + 16] = (d * s[:, 2 * part + l0 // 16])[:, None] * q[:, l0 : l0 + 16]
    return out.reshape(rows, cols)


def _tokenizer_fields(writer: GGUFWriter, tok: Any = None) -> None:
    """A byte-level BPE tokenizer (the tiny one unless given) as a GGUF "gpt2" tokenizer,
    as llama.cpp's converter writes Qwen2's: added special tokens are control tokens."""
    given, tok = tok is not None, tok or tiny_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok.get_vocab()  # the model's tokens and the added ones
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    added = {i: t for i, t in tok.added_tokens_decoder.items()}
    special = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}
    types = [3 if i in special or (i in added and added[i].special) else 4 if i in added else 1
             for i in range(len(tokens))]  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    if given:  # a real model's: whether it adds a bos, and its chat template
        writer.add_add_bos_token(bool(getattr(tok, "add_bos_token", False)))
        if getattr(tok, "chat_template", None):
            writer.add_chat_template(tok.chat_template)


def write_gguf(
    path: Path,
    *,
    arch: str = "qwen2",
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 320,
    tied: bool = False,
    seed: int = 0,
    tokenizer: Any = None,
) -> dict[str, tuple[str, np.ndarray]]:
    """Write a random model to `path` (with `tokenizer`'s vocabulary, else the tiny one's);
    returns each tensor's GGUF name -> (type, raw array)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)  # the embedding's rows; the tokenizer may list fewer ids
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    _tokenizer_fields(writer, tokenizer)
    tensors: dict[str, tuple[str, np.ndarray]] = {}

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        raw = random_q4_k(rng, rows, cols) if kind == "Q4_K" else random_q6_k(rng, rows, cols)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
        tensors[name] = (kind, raw)

    def f32(name: str, *shape: int, around: float = 0.0) -> None:
        value = (around + rng.normal(0, 0.05, shape)).astype(np.float32)
        writer.add_tensor(name, value)
        tensors[name] = ("F32", value)

    matrix("token_embd.weight", vocab, hidden, "Q4_K")
    for i in range(layers):
        b = f"blk.{i}"
        f32(f"{b}.attn_norm.weight", hidden, around=1.0)
        matrix(f"{b}.attn_q.weight", hidden, hidden, "Q4_K")
        matrix(f"{b}.attn_k.weight", kv_heads * head_dim, hidden, "Q4_K")
        matrix(f"{b}.attn_v.weight", kv_heads * head_dim, hidden, "Q6_K" if i % 2 == 0 else "Q4_K")
        if arch == "qwen2":
            f32(f"{b}.attn_q.bias", hidden)
            f32(f"{b}.attn_k.bias", kv_heads * head_dim)
            f32(f"{b}.attn_v.bias", kv_heads * head_dim)
        matrix(f"{b}.attn_output.weight", hidden, hidden, "Q4_K")
        f32(f"{b}.ffn_norm.weight", hidden, around=1.0)
        matrix(f"{b}.ffn_gate.weight", intermediate, hidden, "Q4_K")
        matrix(f"{b}.ffn_up.weight", intermediate, hidden, "Q4_K")
        matrix(f"{b}.ffn_down.weight", hidden, intermediate, "Q6_K" if i % 2 == 0 else "Q4_K")
    f32("output_norm.weight", hidden, around=1.0)
    if not tied:
        matrix("output.weight", vocab, hidden, "Q6_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors
