"""`JsonSchemaConstraint`: decoding kept inside a JSON Schema by llguidance's grammar-constrained decoding (the
`structured` extra, imported only when a constraint is made: without it, an ImportError naming the extra).

Before each token the constraint gives the tokens that may come next (`allowed`) and takes the one chosen
(`advance`); the documents it admits are compact JSON, strict as OpenAI's structured outputs. A schema is refused
with a ValueError before any token is decoded when it is not JSON, nests more than `MAX_SCHEMA_DEPTH` levels,
matches no finite document (local references that recurse without end) or does not compile, and so is a
tokenizer llguidance cannot read (one neither byte-level nor SentencePiece-style)."""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

MAX_SCHEMA_DEPTH = 64  # a JSON Schema nested deeper is refused (500-900 levels once raised RecursionError)


class JsonSchemaConstraint:
    """Keeps an answer inside a JSON Schema (grammar-constrained decoding with llguidance): before each
    token, only the tokens that can continue a document matching the schema may be chosen; once the
    document is complete, only end of sequence. Compact JSON (no free whitespace between tokens), and
    strict as OpenAI's structured outputs are: an object schema with `properties` that does not say
    `additionalProperties` gets none (else any key of any length may follow the listed ones)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int], schema: str) -> None:
        try:
            import llguidance
        except ImportError as e:
            raise ImportError(
                "answers constrained to a JSON Schema need llguidance: pip install 'rag-kvcache[structured]'"
            ) from e
        try:
            document = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not JSON: {e}: {schema[:200]!r}") from e
        except RecursionError:
            document = None  # deeper than the parser goes: refused below
        if document is None or (depth := _depth(document)) > MAX_SCHEMA_DEPTH:
            levels = "more levels than the JSON parser reads" if document is None else f"{depth} levels"
            raise ValueError(f"json_schema nests {levels} deep; at most {MAX_SCHEMA_DEPTH} are accepted")
        if not _satisfiable(document):
            raise ValueError(
                f"json_schema {schema[:200]!r} matches no JSON document: its references recurse without end "
                "(every value it allows must hold another value of itself)"
            )
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            _closed(document), defaults={"whitespace_flexible": False}
        )
        self.matcher = llguidance.LLMatcher(
            _guidance_tokenizer(tokenizer, tuple(sorted(eos_token_ids))), grammar, log_level=0
        )
        if self.matcher.is_error():
            raise ValueError(f"cannot constrain decoding to JSON Schema {schema[:200]!r}: {self.matcher.get_error()}")

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """The tokens that may come next, bool [vocab_size] (ids the tokenizer does not know are never allowed)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(n / 32)]
        bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()  # [32 * ceil(n / 32)]
        allowed = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        n = min(vocab_size, bits.numel())
        allowed[:n] = bits[:n]
        return allowed

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not continue the JSON Schema's grammar: {self.matcher.get_error()}")


def _depth(document: object) -> int:
    """How deeply a JSON document nests lists and objects (a scalar: 0), without recursion."""
    deepest, todo = 0, [(document, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth + 1)
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _satisfiable(document: object) -> bool:
    """Whether some finite JSON value can match the JSON Schema `document`, as far as its local references
    (`$ref: "#..."`) decide: a schema whose every instance must hold an instance of itself (`{"$ref": "#"}`, an
    object that requires a property of its own schema) matches none, and llguidance accepts it and decodes
    garbage. Productive references are found as a grammar's productive symbols are: a fixed point, each round
    judging every referenced schema with the references found productive so far. Keywords other than those
    that can make a value required (`type`, `required`, `minItems`, `allOf`/`anyOf`/`oneOf`, `enum`) are
    taken as satisfiable."""
    targets = {"#"}
    todo = [document]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
                targets.add(ref)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    resolved = {ref: _pointer(document, ref) for ref in targets}
    productive: set[str] = set()
    grew = True
    while grew:
        grew = False
        for ref, schema in resolved.items():
            if ref not in productive and _matches_some(schema, productive):
                productive.add(ref)
                grew = True
    return "#" in productive


_MISSING = object()


def _pointer(document: object, ref: str) -> object:
    """The part of `document` a local reference names (`#`, `#/$defs/x`); a name that leads nowhere: `{}` (no
    constraint here: llguidance refuses it itself)."""
    node = document
    for part in ref.removeprefix("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part, _MISSING)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            node = _MISSING
        if node is _MISSING:
            return {}
    return node


def _matches_some(schema: object, productive: set[str]) -> bool:
    """Whether some value can match `schema` when the references in `productive` (and no others) can be met."""
    if schema is False:
        return False
    if not isinstance(schema, dict):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in productive:
        return False
    if "enum" in schema and isinstance(schema["enum"], list) and not schema["enum"]:
        return False
    if isinstance(parts := schema.get("allOf"), list) and not all(_matches_some(p, productive) for p in parts):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(parts := schema.get(key), list) and not any(_matches_some(p, productive) for p in parts):
            return False
    types = schema.get("type")
    if types is None or "enum" in schema or "const" in schema:
        return True
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    return not kinds or any(_kind_matches_some(kind, schema, productive) for kind in kinds)


def _kind_matches_some(kind: object, schema: dict, productive: set[str]) -> bool:
    """Whether some value of JSON type `kind` can match `schema`: an object's required properties and an array's
    first `minItems` items must each be satisfiable; other types always are."""
    if kind == "object":
        properties = given if isinstance(given := schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties", True)
        required = named if isinstance(named := schema.get("required"), list) else []
        return all(_matches_some(properties.get(name, extra), productive) for name in required if isinstance(name, str))
    if kind == "array":
        least = schema.get("minItems", 0)
        if not isinstance(least, int) or least < 1:
            return True
        prefix = items if isinstance(items := schema.get("prefixItems"), list) else []
        if not all(_matches_some(item, productive) for item in prefix[:least]):
            return False
        return least <= len(prefix) or _matches_some(schema.get("items", True), productive)
    return True


def _closed(schema: object) -> object:
    """`schema` with `"additionalProperties": false` in every object schema that lists `properties` and
    says nothing about other keys (nested ones, `$defs`, `items`, `anyOf`, ... included)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@functools.lru_cache(maxsize=8)
def _guidance_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast Hugging Face tokenizer (built in ~0.4 s, so kept per tokenizer)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos_token_ids))
    except ValueError as e:  # e.g. a WordPiece tokenizer, whose decoder puts spaces between tokens
        raise ValueError(
            f"answers constrained to a JSON Schema need a byte-level or SentencePiece-style fast tokenizer; "
            f"{type(tokenizer).__name__} of {tokenizer.name_or_path!r} is not one: {e}"
        ) from e
