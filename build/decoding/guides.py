"""Guided decoding: the grammars the gateway constrains a request's output with, in the form both targets run.

TensorRT-LLM 1.2.1's tensorrtllm Triton backend does guided decoding with xgrammar (NVIDIA/TensorRT-LLM, 1.2 line;
xgrammar 0.1.32 there and here: build/gpu_image.py):

- triton_backend/inflight_batcher_llm/src/model_instance_state.cc getGuidedDecodingConfigFromParams: with
  guided_decoding_backend "xgrammar" and xgrammar_tokenizer_info_path set, it parses that JSON file and reads its
  "encoded_vocab" (strings), "tokenizer_str" and "stop_token_ids" (ints), all three with no default, into the
  executor's GuidedDecodingConfig (either parameter empty: guided decoding off).
- triton_backend/inflight_batcher_llm/src/utils.cc getGuidedDecodingParamsFromTensors: guided_decoding_guide_type
  "json", "json_schema", "regex" or "ebnf_grammar" (any other string: the request is silently not guided) and
  guided_decoding_guide, the guide's text.
- cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp GuidedDecoder::GuidedDecoder: vocab type and add_prefix_space
  from xgrammar::TokenizerInfo::DetectMetadataFromHF(tokenizer_str), then TokenizerInfo(encoded_vocab, that type,
  the engine's padded vocab size, stop_token_ids, add_prefix_space); GuidedDecoder::build compiles "json" with
  CompileBuiltinJSONGrammar, "json_schema" with CompileJSONSchema (xgrammar's defaults: any whitespace),
  "regex" with CompileRegex and "ebnf_grammar" with CompileGrammar (root rule "root").
- examples/generate_xgrammar_tokenizer_info.py writes that file: tensorrt_llm/llmapi/tokenizer.py
  _xgrammar_tokenizer_info of AutoTokenizer.from_pretrained(model_dir): the vocabulary's tokens sorted by id,
  backend_tokenizer.to_str() and [eos_token_id].

The gateway builds every grammar here and sends it as an EBNF guide, so the GPU engine and the CPU runtime
(runtime/guided.py, PyPI xgrammar over the same file) run the very same grammar: JSON without free whitespace
(xgrammar's json_schema guide would allow unbounded runs of it), Qwen3-VL's tool-call blocks, and for Thinking
checkpoints the reasoning that comes first.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CheckpointError, RequestError

if TYPE_CHECKING:
    import xgrammar

GUIDE_TYPE_EBNF = "ebnf_grammar"  # utils.cc guideTypeMapping: kEBNF_GRAMMAR
# The guide types utils.cc getGuidedDecodingParamsFromTensors maps; with any other the request runs unguided.
GUIDE_TYPES = ("json", "json_schema", "regex", GUIDE_TYPE_EBNF)

# Qwen3-VL's chat template asks for each call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`;
# it renders parallel calls one per line.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"

_T = TypeVar("_T")


class GuideError(RequestError):
    """A JSON schema, tool list or grammar that guided decoding cannot enforce; the message says which part."""


@dataclass(frozen=True)
class Guide:
    """What a request sends as guided_decoding_guide_type and guided_decoding_guide."""

    type: str
    text: str


def json_schema_guide(schema: dict[str, Any], think_end: str | None = None) -> Guide:
    """Output that is one JSON value valid for `schema`, without free whitespace (", " and ": " only).

    think_end (Thinking checkpoints, whose generation prompt opened the reasoning): free text up to the first
    think_end first, then at most two newlines, then the JSON."""
    return _guide(_schema_grammar(schema), think_end)


def json_object_guide(think_end: str | None = None) -> Guide:
    """Any JSON object (response_format json_object), without free whitespace."""
    # strict_mode leaves a bare {"type": "object"} open to any keys and values (basic_object in the EBNF).
    return json_schema_guide({"type": "object"}, think_end)


def tool_call_guide(
    functions: Sequence[dict[str, Any]], named: str | None, parallel: bool, think_end: str | None = None
) -> Guide:
    """One call (parallel: one or more, a newline apart) of `functions` (OpenAI function objects: name, parameters),
    each a `<tool_call>` block whose arguments are valid for that function's parameters; named: only that one."""
    params: dict[str, Any] = {}
    for function in functions:
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise GuideError(f"a tool function has no name: {json.dumps(function)[:200]}")
        params[name] = function.get("parameters") or {"type": "object"}
    if named is not None:
        if named not in params:
            raise GuideError(f"tool_choice names the function {named!r}, which is not among the tools")
        params = {named: params[named]}
    if not params:
        raise GuideError("tool calls need at least one tool function")
    # One call schema per function under the root's $defs (xgrammar's $ref pointers cannot index an anyOf list),
    # keys in this order so that a call reads {"name": ..., "arguments": ...} as the template shows it.
    calls = {
        f"call_{i}": {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": _rebase_refs(p, f"#/$defs/call_{i}/properties/arguments"),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, (name, p) in enumerate(params.items())
    }
    call = {"anyOf": [{"$ref": f"#/$defs/{key}"} for key in calls], "$defs": calls}
    xgr = _xgrammar()
    block = xgr.Grammar.concat(
        _ebnf(f"root ::= {_literal(TOOL_CALL_OPEN)}"),
        _schema_grammar(call),
        _ebnf(f"root ::= {_literal(TOOL_CALL_CLOSE)}"),
    )
    return _guide(_one_or_more(block, TOOL_CALL_SEPARATOR) if parallel else block, think_end)


def check_guide(guide_type: str, text: str | None) -> None:
    """GuideError unless the engine can compile this guide. The executor compiles a request's guide inside the
    batch's forward step, where an exception ends every request in flight (trtGptModelInflightBatching.cpp
    terminateActiveRequests), so preprocessing parses each guide first, as the executor would, and refuses one that
    does not parse, or of a type the backend would silently run unguided. Only "json" goes without a text
    (executor GuidedDecodingParams)."""
    if guide_type not in GUIDE_TYPES:
        raise GuideError(f"guided_decoding_guide_type {guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
    if guide_type == "json":
        return
    if not text:
        raise GuideError(f"a {guide_type} guide needs its guided_decoding_guide")
    grammar = _xgrammar().Grammar
    parse = {"json_schema": grammar.from_json_schema, "regex": grammar.from_regex, GUIDE_TYPE_EBNF: grammar.from_ebnf}
    xgrammar_call(lambda: parse[guide_type](text), f"the {guide_type} guide")


def write_tokenizer_info(model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int], path: Path) -> None:
    """Writes the xgrammar tokenizer info of the checkpoint's tokenizer.json to `path`, as
    examples/generate_xgrammar_tokenizer_info.py does, for the engine's vocab_size (the logits' width).

    stop_token_ids: the ids a guided output may end with (the grammar allows nothing else once it is complete), so
    the ids the engine ends a request on; upstream writes the tokenizer's eos_token_id alone."""
    from transformers import PreTrainedTokenizerFast

    # Upstream's AutoTokenizer runs under transformers 4.x (TensorRT-LLM's requirements.txt pin), which keeps
    # tokenizer.json's pipeline; transformers 5's Qwen2Tokenizer rebuilds its pre-tokenizer and decoder
    # (add_prefix_space, trim_offsets), so the file is read as it is. (The vocab type and add_prefix_space that
    # xgrammar detects from either string are the same for Qwen's tokenizer.)
    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{model_dir} has no tokenizer.json, which guided decoding's tokenizer info is made from")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(file))
    vocab = tokenizer.get_vocab()
    ids = sorted(vocab.values())
    # Upstream lists the tokens in id order without their ids: that is token id i at index i only without gaps.
    if ids != list(range(len(ids))):
        raise CheckpointError(f"{file}: token ids are not 0..{len(ids) - 1} without gaps")
    if len(ids) > vocab_size:
        raise CheckpointError(f"{file} has {len(ids)} tokens, more than the model's vocab_size {vocab_size}")
    stops = [int(i) for i in stop_token_ids]
    if not stops or not all(0 <= i < vocab_size for i in stops):
        raise CheckpointError(f"stop_token_ids must be ids below vocab_size {vocab_size}, got {stops}")
    info = {
        "encoded_vocab": sorted(vocab, key=vocab.__getitem__),
        "tokenizer_str": tokenizer.backend_tokenizer.to_str(),
        "stop_token_ids": stops,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from a server running as another user
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_tokenizer_info(path: Path, vocab_size: int) -> xgrammar.TokenizerInfo:
    """The xgrammar TokenizerInfo of a write_tokenizer_info file, built as guidedDecoder.cpp builds it for an
    engine whose logits are vocab_size wide."""
    xgr = _xgrammar()
    try:
        info = json.loads(Path(path).read_text())
        encoded_vocab, tokenizer_str, stops = info["encoded_vocab"], info["tokenizer_str"], info["stop_token_ids"]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path} is not an xgrammar tokenizer info file: {e!r}") from e
    if len(encoded_vocab) > vocab_size:
        raise CheckpointError(f"{path} lists {len(encoded_vocab)} tokens, more than the vocab_size {vocab_size}")
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_str)  # the binding of DetectMetadataFromHF
    return xgr.TokenizerInfo(
        encoded_vocab,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=metadata["add_prefix_space"],
    )


def _xgrammar() -> Any:
    import xgrammar  # only guided decoding needs it

    return xgrammar


def xgrammar_call(fn: Callable[[], _T], what: str) -> _T:
    """fn(), with xgrammar's errors (C++ checks, as RuntimeError) turned into a GuideError naming `what`."""
    try:
        return fn()
    except Exception as e:
        # "[12:00:00] /project/cpp/json_schema_converter.cc:902: Check failed: (...) is false: reason" -> "reason"
        reason = re.sub(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?", "", str(e).strip())
        raise GuideError(f"{what} cannot be enforced: {reason}") from e


def _ebnf(text: str) -> xgrammar.Grammar:
    return xgrammar_call(lambda: _xgrammar().Grammar.from_ebnf(text), "the grammar")


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # xgrammar's EBNF strings take JSON's escapes


# Keywords xgrammar's JSON-schema converter ignores (or, allOf of several, only warns about; read at 0.1.25): a
# schema with them would be enforced only in part, so it is refused rather than half kept.
_IGNORED_KEYWORDS = frozenset(
    {"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "multipleOf", "uniqueItems"}
)
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"const", "enum", "default", "examples"})


def _check_enforceable(schema: Any, where: str = "#") -> None:
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_enforceable(item, f"{where}/{i}")
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _IGNORED_KEYWORDS and not (key == "uniqueItems" and value is False):
            raise GuideError(f"JSON schema keyword {key!r} at {where} cannot be enforced by guided decoding")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise GuideError(f"JSON schema allOf of several schemas at {where} cannot be enforced by guided decoding")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise GuideError(f"JSON schema $ref {value!r} at {where}: only references inside the schema (#...) work")
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                _check_enforceable(sub, f"{where}/{key}/{name}")
        elif key not in _DATA:
            _check_enforceable(value, f"{where}/{key}")


def _rebase_refs(schema: Any, base: str) -> Any:
    """schema with its local $refs ("#/...") pointing at the same place once it sits at JSON pointer `base`."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            rebased[k] = base + v[1:]
        else:
            rebased[k] = v if k in _DATA else _rebase_refs(v, base)
    return rebased


def _schema_grammar(schema: dict[str, Any]) -> xgrammar.Grammar:
    if not isinstance(schema, dict):
        raise GuideError(f"a JSON schema must be an object, got {json.dumps(schema)[:200]}")
    _check_enforceable(schema)
    xgr = _xgrammar()
    text = xgrammar_call(lambda: json.dumps(schema, allow_nan=False), "the JSON schema")
    return xgrammar_call(
        lambda: xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True), "the JSON schema"
    )


def _guide(body: xgrammar.Grammar, think_end: str | None) -> Guide:
    if think_end is not None:
        body = _xgrammar().Grammar.concat(_reasoning(think_end), body)
    return Guide(GUIDE_TYPE_EBNF, str(body))  # xgrammar prints EBNF that from_ebnf reads back


def _reasoning(think_end: str) -> xgrammar.Grammar:
    """Any text without think_end, then think_end and at most two newlines (Qwen3's "</think>\\n\\n")."""
    if not think_end or not think_end.isascii():
        # xgrammar clamps the bytes above 127 out of a negated character class, which the automaton relies on.
        raise ValueError(f"think_end must be a non-empty ASCII string, got {think_end!r}")
    return _ebnf(_until(think_end, "think") + '\nroot ::= think_0 ("" | "\\n" | "\\n\\n")')


def _until(stop: str, name: str) -> str:
    """EBNF rules {name}_0 .. {name}_{m-1} matching any text that does not contain `stop`, then `stop`: a KMP
    automaton whose rule k means that the text so far ends with stop's first k characters (and holds no stop)."""
    m = len(stop)

    def step(k: int, c: str) -> int:  # the longest prefix of stop that stop[:k] + c ends with
        seen = stop[:k] + c
        return next(j for j in range(min(len(seen), m), -1, -1) if seen.endswith(stop[:j]))

    rules = []
    for k in range(m):
        moves: dict[int, list[str]] = {}
        for c in sorted(set(stop)):
            moves.setdefault(step(k, c), []).append(c)
        moves.pop(0, None)  # every other character (any outside stop too) goes back to rule 0
        onward = [c for cs in moves.values() for c in cs]
        alts = [_char_class(cs) + ("" if j == m else f" {name}_{j}") for j, cs in sorted(moves.items())]
        if k == 0:  # a run of characters that cannot start stop: one character-class star, not a recursion each
            rules.append(f"{name}_0 ::= {_char_class(onward, negate=True)}* ({' | '.join(alts)})")
        else:
            rules.append(f"{name}_{k} ::= {' | '.join([*alts, f'{_char_class(onward, negate=True)} {name}_0'])}")
    return "\n".join(rules)


def _char_class(chars: Sequence[str], negate: bool = False) -> str:
    def esc(c: str) -> str:
        if c in "\\]^-[":
            return "\\" + c
        return f"\\x{ord(c):02x}" if ord(c) < 0x20 or c == "\x7f" else c

    return f"[{'^' if negate else ''}{''.join(esc(c) for c in chars)}]"


# A token of xgrammar's printed EBNF: a string, a character class, or a name (which may hold "." and "-").
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[\w.\-]+')


def _one_or_more(item: xgrammar.Grammar, separator: str) -> xgrammar.Grammar:
    """item (separator item)*: item's rules with its root renamed, under a new root (xgrammar's concat and union
    cannot repeat)."""
    text = str(item)
    names = set(re.findall(r"^([\w.\-]+) ::=", text, re.MULTILINE))
    name = "item"
    while name in names:
        name += "_"
    renamed = _EBNF_TOKEN.sub(lambda t: name if t.group() == "root" else t.group(), text)
    return _ebnf(f"root ::= {name} ({_literal(separator)} {name})*\n{renamed}")
