"""Tokenizer, chat template and incremental detokenization for a Hugging Face model directory.

Built on the `tokenizers` library (the `tokenizer.json` format) and jinja2 for chat templates,
rendered the way transformers renders them, so prompts match what a model was trained on.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

# How many prompt tokens the generic detokenizer decodes as context in front of the output, so
# decoders that treat the start of a text specially (leading-space stripping) see a middle.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


# repr=False: the backend's repr spells out the whole vocabulary.
@dataclass(eq=False, repr=False)
class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens, stop tokens and its chat template."""

    backend: BackendTokenizer
    _: KW_ONLY
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    generation_eos_token_ids: Sequence[int] = ()
    truncation_side: str = "right"
    """Which end a prompt cut to `truncate_prompt_tokens` loses by default: "right" keeps
    its first tokens (Hugging Face's default), "left" its last."""

    def __post_init__(self) -> None:
        # A copy: the cached stop ids are derived from it, so a caller's list must not change it.
        self.generation_eos_token_ids = tuple(self.generation_eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: Path | str) -> Tokenizer:
        """Load from a model directory: tokenizer.json, plus tokenizer_config.json,
        chat_template.jinja and generation_config.json when present."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{directory} has no tokenizer.json; a model directory needs one (fast tokenizer "
                "format) to be served"
            )
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")

        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            template: str | None = template_file.read_text(encoding="utf-8")
        else:
            template = _default_template(config.get("chat_template"))

        eos_ids = generation.get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
            generation_eos_token_ids=[int(i) for i in eos_ids or ()],
            truncation_side="left" if config.get("truncation_side") == "left" else "right",
        )

    # -- encoding and decoding ---------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        # tokenizer.json post-processors add BOS for some models; the config flag covers those
        # whose tokenizer.json does not, without ever doubling it.
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    # -- special tokens ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @cached_property
    def eos_token_id(self) -> int | None:
        if self.eos_token is not None:
            return self.backend.token_to_id(self.eos_token)
        return self.generation_eos_token_ids[0] if self.generation_eos_token_ids else None

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's EOS and every generation_config EOS id."""
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return frozenset((*eos, *self.generation_eos_token_ids))

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        ends = (i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        return self._added_special_ids.union(ends)

    @cached_property
    def _added_special_ids(self) -> frozenset[int]:
        """The ids `decode(..., skip_special_tokens=True)` drops."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in added.items() if tok.special)

    @cached_property
    def _byte_level_table(self) -> list[bytes] | None:
        """Each id's UTF-8 bytes when the decoder is plain byte-level BPE, else None.

        Mirrors the ByteLevel decoder: a token spelled in the byte alphabet maps back to those
        bytes; any other token (an added token such as a CJK word) stands for its own UTF-8.
        """
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        byte_of = {char: byte for byte, char in _byte_alphabet().items()}
        table = []
        for token_id in range(self.vocab_size):
            token = self.backend.id_to_token(token_id) or ""
            if all(char in byte_of for char in token):
                table.append(bytes(byte_of[char] for char in token))
            else:
                table.append(token.encode("utf-8"))
        return table

    # -- chat template -----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation into the model's prompt text, through `chat_template` if
        given, else the model's own.

        Each message is a dict with a string `role` and a `content` that is a string or a list
        of `{"type": "text", "text": ...}` parts (joined with newlines); an assistant message
        that calls tools may have no content (null), and its calls' `arguments` (JSON text, as
        OpenAI sends them) reach the template as objects, as transformers expects. Extra
        keyword arguments (tools, documents, ...) are passed to the template.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt (completions) instead"
            )
        conversation = _normalize_messages(messages)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(kwargs)
        try:
            return compile_template(source).render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the conversation: {exc}") from exc


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time.

    `add` returns only completed text: bytes of a character split across tokens are held back
    until the character is whole, so no delta ever ends in half a character. Call `finish` when
    the sequence ends; it returns whatever was still held (as U+FFFD, exactly as a full decode
    renders an unfinished character). For byte-level BPE tokenizers the deltas then concatenate
    to exactly `tokenizer.decode(output_ids)`; for other decoders they concatenate to the text
    the output adds after the prompt (so a leading space stripped at the start of a text is
    kept, as it is in the prompt-plus-output text). One exception, inherent to byte-fallback
    decoders: a run of byte tokens that is not valid UTF-8 is rendered as a whole by a full
    decode, so a valid head of such a run may stream out as text; models do not emit such runs.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._table = tokenizer._byte_level_table
        if self._table is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._skipped = tokenizer._added_special_ids if skip_special_tokens else frozenset()
            return
        # Generic path: decode a sliding window [prefix, end) and emit what lies past `read`.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt cut mid-character would corrupt the first delta
        self._ids = context
        self._prefix = 0
        self._read = len(context)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (often '' or one word)."""
        if self._table is not None:
            if token_id in self._skipped or not 0 <= token_id < len(self._table):
                return ""
            delta = self._utf8.decode(self._table[token_id])
        else:
            self._ids.append(token_id)
            delta = self._window_delta(final=False)
        return delta

    def finish(self) -> str:
        """End the sequence: return the text still held back (a trailing partial character)."""
        if self._table is not None:
            delta = self._utf8.decode(b"", final=True)
        else:
            delta = self._window_delta(final=True)
        return delta

    def _window_delta(self, *, final: bool) -> str:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix : self._read])
        new_text = self._decode(ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        # Keep only the window: the ids before it never influence later text.
        del ids[: self._read]
        self._prefix, self._read = 0, len(ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(spec: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(spec, Mapping):
        return spec.get("content")
    return spec if isinstance(spec, str) else None


def _default_template(spec: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    if isinstance(spec, list):
        named = {item.get("name"): item.get("template") for item in spec if isinstance(item, dict)}
        return named.get("default")
    return spec if isinstance(spec, str) else None


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    normalized = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string")
        entry = dict(message)
        calls = entry.get("tool_calls")
        if role == "assistant" and calls is not None:
            entry["tool_calls"] = _tool_calls(calls, where)
            if entry.get("content") is None:
                entry["content"] = ""
        if "content" not in entry:
            raise ValueError(f"{where} has no 'content'")
        normalized.append({**entry, "content": _content_text(entry["content"], where)})
    return normalized


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, their JSON `arguments` text parsed into objects."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    parsed = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{where}.tool_calls[{index}] must be {{'id': ..., 'type': 'function', "
                "'function': {'name': <string>, 'arguments': <JSON text>}}"
            )
        arguments = function.get("arguments", "{}")  # type: ignore[union-attr]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise ValueError(
                    f"{where}.tool_calls[{index}].function.arguments is not JSON: {exc}"
                ) from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})  # type: ignore[dict-item]
    return parsed


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ValueError(
                f"{where}.content[{index}] must be {{'type': 'text', 'text': <string>}}; "
                "only text content is supported"
            )
        texts.append(part["text"])
    return "\n".join(texts)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    some templates; rendering a prompt just keeps its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters, which templates do not expect in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def load_chat_template(value: str) -> str:
    """--chat-template's value, as vLLM reads it: the template itself when it holds a brace
    or a newline, else the path of a file holding it. Checked by compiling it."""
    if any(ch in value for ch in "{}\n"):
        source = value
    else:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--chat-template: {value} is not a file, nor a template")
        source = path.read_text(encoding="utf-8")
    compile_template(source)
    return source


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A chat template, compiled once; a syntax error is a ValueError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the model's chat template is not valid jinja: {exc}") from exc


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (printable Latin-1
    bytes stand for themselves, the rest are shifted past U+0100)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet
