"""Request bodies of the HTTP APIs and their translation into prompts and SamplingParams.

Every field a client may send is understood, never silently ignored. Each model knows the whole of its
API's schema (SGLang's GenerateReqInput and SamplingParams, OpenAI's completions and chat completions
with SGLang's extensions) in three kinds: fields the server implements; metadata, which cannot change a
request's tokens and is accepted whatever its (well-typed) value; and features not implemented yet,
accepted only at their neutral value (null, the default) and otherwise a 400 "<field>: <value> is not
supported yet". The catalogue of the last two is the tables below. Keys outside the schema are a 400
(extra=forbid), as OpenAI's own API answers an unrecognized argument.

Models are strict (no "5" for 5, no true for 1) so that a wrong type is a 400 naming the field rather
than a silent coercion. A requested length that does not fit in the context after the prompt is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, create_model, model_validator
from pydantic_core import PydanticCustomError

from specpilot.bench.datasets import Prompt, apply_chat_template
from specpilot.config import SamplingParams
from specpilot.models.prompts import encode_prompt

# SGLang's treatment of tiny temperatures: below this, sampling is greedy (dividing logits by ~1e-40
# would overflow to inf and poison the softmax).
GREEDY_TEMPERATURE = 1e-6
SHOWN_VALUE_CHARS = 60  # an unsupported value is quoted in the 400 up to this length

Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1, description="torch generator seed")]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(description="token ids")]
NonNegInt = Annotated[int, Field(ge=0)]
Model = TypeVar("Model", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# ---- the catalogue's machinery --------------------------------------------------------------------
def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS] + "..."


def _same(value: Any, neutral: Any) -> bool:
    """value == neutral without JSON's puns (false is not 0), except that 1 stands for 1.0."""
    return value == neutral and (type(value) is type(neutral) or (type(value) is int and type(neutral) is float))


def _neutral_type(neutral: tuple[Any, ...], per_item: bool) -> Any:
    def check(value: Any) -> Any:
        if any(_same(value, n) for n in neutral) or (
                per_item and isinstance(value, list) and all(any(_same(v, n) for n in neutral) for v in value)):
            return value
        raise PydanticCustomError("unsupported", "{value} is not supported yet (accepted: {accepted})",
                                  {"value": _show(value), "accepted": ", ".join(map(_show, neutral))})

    schema: dict[str, Any] = {"enum": list(neutral)}
    if per_item:
        schema = {"anyOf": [schema, {"type": "array", "items": schema}]}
    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema)]


def neutral_only(table: dict[str, tuple[Any, ...]], per_item: bool = False) -> dict[str, Any]:
    """Field types of features not implemented (name -> its neutral values: null, the API's default,
    their equivalents): a neutral value passes, anything else is an error naming the value. per_item: a
    list of neutral values passes too (SGLang lets a batch give one value per prompt)."""
    return {name: _neutral_type(neutral, per_item) for name, neutral in table.items()}


def with_fields(*tables: dict[str, Any]) -> Callable[[type[Model]], type[Model]]:
    """Class decorator adding the tables' fields (name -> type, default null), which the server never reads."""
    def extend(cls: type[Model]) -> type[Model]:
        fields: dict[str, Any] = {name: (kind, None) for table in tables for name, kind in table.items()}
        return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__, **fields)
    return extend


NULL, OFF, ON = (None,), (None, False), (None, True)
GRAMMAR = (None, "")  # SGLang reads an empty grammar as none

# ---- the catalogue: metadata (name -> type) and features not implemented (name -> neutral values) ----
# SGLang's request fields, on /generate and on its OpenAI API alike
SGLANG_METADATA: dict[str, Any] = {
    "session_id": str | None,  # groups a session's requests; unlike session_params it leaves the prompt alone
    "priority": int | None,  # scheduling order (SGLang's priority scheduling); the scheduler here is FCFS
    "extra_key": str | list[str] | None,  # prefix-cache namespace: there is no prefix cache here
    "cache_salt": str | list[str] | None,  # the same
    "custom_labels": dict[str, str] | None,  # labels of SGLang's Prometheus metrics
}
SGLANG_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(["lora_path", "custom_logit_processor", "session_params", "sampling_logprobs_mode",
                     "video_config", "images_config", "mm_processor_kwargs", "max_dynamic_patch",
                     "min_dynamic_patch"], NULL),
    **dict.fromkeys(["return_hidden_states", "return_routed_experts", "return_sampling_mask",
                     "return_flat_raw_output_top_logprobs", "return_prompt_token_ids", "use_audio_in_video"], OFF),
    "routed_experts_start_len": (None, 0),
    # prefill/decode disaggregation and data-parallel routing: this server is one worker, DP rank 0
    **dict.fromkeys(["bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"], NULL),
    "routed_dp_rank": (None, 0), "data_parallel_rank": (None, 0),
}
# SGLang's sampling_params keys, and the OpenAI API's of the same name
SAMPLING_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0.0), "presence_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "logit_bias": (None, {}), "beam_width": (None, 1),
    "structural_tag": GRAMMAR, "stop_regex": (None, "", []),
    "custom_params": (None, {}), "watermark": NULL,
    # detokenization: special tokens are skipped, stop strings trimmed from the text
    "skip_special_tokens": ON, "spaces_between_special_tokens": ON, "no_stop_trim": OFF,
}
GENERATE_METADATA: dict[str, Any] = SGLANG_METADATA | {
    "log_metrics": bool,  # this server keeps no per-request metrics
    "no_logs": bool,  # it never logs request contents
    "routing_key": str | None,  # a router's choice among workers; there is one
    "conversation_id": str | None,  # request tracking
    "received_time": float | None,  # a router's timestamp, for its latency metrics
    "external_trace_header": dict[str, Any] | None,  # tracing context
    "http_worker_ipc": str | None,  # SGLang's multi-tokenizer IPC; this is one process
    "kv_hints": dict[str, Any] | list[dict[str, Any] | None] | None,  # hints to HiCache storage; none here
}
GENERATE_UNSUPPORTED: dict[str, tuple[Any, ...]] = SGLANG_UNSUPPORTED | {
    **dict.fromkeys(["input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
                     "modalities", "image_max_dynamic_patch", "video_max_dynamic_patch", "need_wait_for_mm_inputs",
                     "num_items_assigned", "encoder_urls", "watermark", "lora_id",
                     "positional_embed_overrides", "bootstrap_pair_key", "decode_tp_size", "max_thinking_tokens",
                     "multi_item_delimiter_indices", "token_indices_to_pool"], NULL),
    **dict.fromkeys(["return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64",
                     "return_indexer_topk", "return_bytes", "return_entropy", "background", "require_reasoning"],
                    OFF),
}
OPENAI_METADATA: dict[str, Any] = SGLANG_METADATA | {
    "user": str | None, "safety_identifier": str | None,  # end-user identity, for abuse monitoring
    "metadata": dict[str, str] | None, "store": bool | None,  # stored-completion tags; nothing is stored here
    "service_tier": str | None,  # latency/price tier
    # prompt-cache hints: there is no prompt cache here
    "prompt_cache_key": str | None, "prompt_cache_retention": str | None, "prompt_cache_options": dict[str, Any] | None,
}
OPENAI_UNSUPPORTED: dict[str, tuple[Any, ...]] = SAMPLING_UNSUPPORTED | {
    # SGLang's extensions
    **dict.fromkeys(["rid", "input_ids", "thinking", "task"], NULL),
    **dict.fromkeys(["return_token_ids", "return_meta_info", "return_cached_tokens_details",
                     "return_spec_tokens_details", "return_input_ids_in_sglext", "return_output_ids_in_sglext"], OFF),
}
CHAT_METADATA: dict[str, Any] = {
    "parallel_tool_calls": bool | None,  # only matters with tools, which are refused
    "separate_reasoning": bool | None, "stream_reasoning": bool | None,  # SGLang's, for a --reasoning-parser: none
    "return_flat_raw_top_logprobs_b64": bool | None,  # SGLang's encoding of flat logprobs, which are refused
}
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # tools: "auto" without tools cannot call one
    "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "continue_final_message": OFF, "chat_template_kwargs": (None, {}),
    **dict.fromkeys(["audio", "prediction", "reasoning_effort", "verbosity", "web_search_options", "moderation"],
                    NULL),
}
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"echo": OFF, "suffix": (None, ""), "best_of": (None, 1)}


# ---- shared by both APIs --------------------------------------------------------------------------
def _strings(value: str | list[str] | None) -> list[str] | None:
    return [value] if isinstance(value, str) else value


def synonym(values: dict[str, Any]) -> tuple[str, Any]:
    """(name, value) of the first set of several names for one thing; ValueError when they differ.
    With none set: the first name and None."""
    given = {name: v for name, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise ValueError(" and ".join(f"{name} ({v})" for name, v in given.items()) + " differ: give one")
    return next(iter(given.items()), (next(iter(values)), None))


def fitted_length(name: str, requested: int | None, default: int | None, prompt_len: int,
                  context_length: int) -> int:
    """The number of tokens to generate: `requested` if it fits in the context after the prompt (else
    ValueError naming `name`); without one, `default` clamped to what fits (None: up to the context end)."""
    room = max(context_length - prompt_len, 0)
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > context_length:
        raise ValueError(f"prompt ({prompt_len} tokens) + {name} ({requested}) exceeds the context length "
                         f"({context_length})")
    return requested


def sampling_params(fields: dict[str, Any], vocab_size: int) -> SamplingParams:
    """SamplingParams from the keys a client set (the rest keep SamplingParams' defaults).
    Raises ValueError naming the offending field."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if 0 < fields.get("temperature", 0) < GREEDY_TEMPERATURE:
        fields["temperature"] = 0.0
    for name in ("stop_token_ids", "token_ids_logprob"):
        bad = [t for t in fields.get(name, []) if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} must lie in [0, {vocab_size}), got {bad}")
    return SamplingParams(**fields)


def _per_item(name: str, value: Any, n: int, is_list: Callable[[Any], bool]) -> list[Any]:
    """A request-level key SGLang lets a batch give once or once per prompt."""
    if not is_list(value):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} is a list of {len(value)} but the input has {n} prompts")
    return list(value)


def logprobs(wanted: bool | None, top: int | None, named: list[int] | None, start: int | None = None) -> dict[str, Any]:
    """SamplingParams' logprob keys: the others count only where logprobs are wanted (as in SGLang)."""
    if not wanted:
        return {}
    return {"return_logprob": True, "top_logprobs_num": top, "token_ids_logprob": named, "logprob_start_len": start}


MAX_SAMPLES = 64  # n: samples of one prompt


def sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """Sample `sample` of a prompt's n: the first keeps the request's seed (so n = 1 gives its text), each other
    a seed keyed by (seed, sample); without a seed each draws its own."""
    if sample == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed ^ (sample * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1))


class _SamplingKnobs(BaseModel):
    """The sampling keys both APIs spell the same way (SamplingParams' names, and n: samples per prompt)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    # structured output (SGLang's keys; an empty one is none)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def knobs(self) -> dict[str, Any]:
        grammars = {name: getattr(self, name) or None for name in ("json_schema", "regex", "ebnf")}
        return ({name: getattr(self, name) for name in _SamplingKnobs.model_fields if name != "n"}
                | {"stop": _strings(self.stop)} | grammars)


# ---- SGLang /generate -----------------------------------------------------------------------------
# stream_interval only sets how often a stream sends a chunk: the server's --stream-interval sets it for all
@with_fields({"stream_interval": int | None}, neutral_only(SAMPLING_UNSUPPORTED))
class GenerateSampling(_Strict, _SamplingKnobs):
    """SGLang's sampling_params. Unset keys use the engine's defaults (max_new_tokens 128 clamped to
    the context, greedy). sampling_seed is SGLang's name for seed."""

    max_new_tokens: NonNegInt | None = None
    min_new_tokens: NonNegInt | None = None
    sampling_seed: Seed | None = None

    def to_params(self, prompt_len: int, context_length: int, vocab_size: int,
                  logprob_fields: dict[str, Any] | None = None) -> SamplingParams:
        _, seed = synonym({"sampling_seed": self.sampling_seed, "seed": self.seed})
        max_new_tokens = fitted_length("max_new_tokens", self.max_new_tokens, SamplingParams.max_new_tokens,
                                       prompt_len, context_length)
        return sampling_params(self.knobs() | {"seed": seed, "max_new_tokens": max_new_tokens,
                                               "min_new_tokens": self.min_new_tokens} | (logprob_fields or {}),
                               vocab_size)


@with_fields(GENERATE_METADATA, neutral_only(GENERATE_UNSUPPORTED, per_item=True))
class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSampling | list[GenerateSampling] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # logprobs of each output token (meta_info's output_*_logprobs), once or per prompt
    return_logprob: bool | list[bool] | None = None
    top_logprobs_num: NonNegInt | list[NonNegInt] | None = None
    token_ids_logprob: TokenIds | list[TokenIds] | None = None
    logprob_start_len: Annotated[int, Field(ge=-1)] | list[Annotated[int, Field(ge=-1)]] | None = None
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _shape(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        n = self.batch_size
        if self.is_batch and n == 0:
            raise ValueError("the batch is empty")
        for name in ("sampling_params", "rid"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.is_batch or len(value) != n):
                raise ValueError(f"{name} is a list of {len(value)} but the input is "
                                 + (f"a batch of {n}" if self.is_batch else "a single prompt"))
            if name == "rid" and isinstance(value, str) and self.is_batch:
                raise ValueError("a batch needs a list of rids, one per prompt")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        return len(self.text if self.text is not None else self.input_ids) if self.is_batch else 1

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        if self.input_ids is not None:
            return list(self.input_ids) if self.is_batch else [list(self.input_ids)]
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send input_ids instead of text")
        texts = self.text if isinstance(self.text, list) else [self.text]
        return [encode_prompt(tokenizer, t, chat=False) for t in texts]

    def params(self, prompts: list[list[int]], context_length: int, vocab_size: int) -> list[SamplingParams]:
        sp = self.sampling_params
        n = self.batch_size
        per_item = sp if isinstance(sp, list) else [sp or GenerateSampling()] * n
        wanted = _per_item("return_logprob", self.return_logprob, n, lambda v: isinstance(v, list))
        tops = _per_item("top_logprobs_num", self.top_logprobs_num, n, lambda v: isinstance(v, list))
        named = _per_item("token_ids_logprob", self.token_ids_logprob, n,
                          lambda v: self.is_batch and bool(v) and isinstance(v[0], list))
        starts = _per_item("logprob_start_len", self.logprob_start_len, n, lambda v: isinstance(v, list))
        return [p.to_params(len(ids), context_length, vocab_size, logprobs(*asked))
                for p, ids, *asked in zip(per_item, prompts, wanted, tops, named, starts, strict=True)]

    def rids(self) -> list[str | None]:
        return self.rid if isinstance(self.rid, list) else [self.rid] * self.batch_size

    def samples(self) -> list[int]:
        """n per prompt."""
        sp = self.sampling_params
        per_item = sp if isinstance(sp, list) else [sp] * self.batch_size
        return [(p.n if p is not None and p.n is not None else 1) for p in per_item]


# ---- OpenAI-compatible ----------------------------------------------------------------------------
@with_fields(neutral_only({"continuous_usage_stats": OFF, "include_obfuscation": OFF}))
class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema (description and strict are accepted: the schema is always kept)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must follow (json_object: any object; text: none)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        return json.dumps(self.json_schema.json_schema or {})


@with_fields(OPENAI_METADATA, neutral_only(OPENAI_UNSUPPORTED), neutral_only(SGLANG_UNSUPPORTED, per_item=True))
class OpenAISampling(_Strict, _SamplingKnobs):
    """Fields shared by /v1/completions and /v1/chat/completions. Defaults are OpenAI's (temperature
    None means 1); top_k, min_p, ignore_eos, min_tokens and stop_token_ids are SGLang extensions."""

    default_max_tokens: ClassVar[int | None] = None  # without a length: up to the end of the context

    model: str | None = None
    max_tokens: NonNegInt | None = None
    min_tokens: NonNegInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def length(self) -> tuple[str, int | None]:
        """The requested length, by the name the client gave it (None: none given)."""
        return "max_tokens", self.max_tokens

    response_format: ResponseFormat | None = None

    def logprob_fields(self) -> dict[str, Any]:
        """SamplingParams' logprob keys from the endpoint's own spelling of them."""
        return {}

    def grammar_fields(self) -> dict[str, Any]:
        """response_format as SamplingParams' json_schema, beside SGLang's own grammar keys (one of them)."""
        schema = None if self.response_format is None else self.response_format.schema_text()
        if schema is None:
            return {}
        if self.json_schema or self.regex or self.ebnf:
            raise ValueError("response_format and json_schema / regex / ebnf: give one")
        return {"json_schema": schema}

    def to_params(self, prompt_len: int, context_length: int, vocab_size: int) -> SamplingParams:
        max_tokens = fitted_length(*self.length(), self.default_max_tokens, prompt_len, context_length)
        temperature = 1.0 if self.temperature is None else self.temperature
        return sampling_params(self.knobs() | {"max_new_tokens": max_tokens, "min_new_tokens": self.min_tokens,
                                               "temperature": temperature} | self.logprob_fields()
                               | self.grammar_fields(), vocab_size)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


@with_fields(neutral_only(COMPLETION_UNSUPPORTED))
class CompletionRequest(OpenAISampling):
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for completions

    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: NonNegInt | None = None  # each token's logprob and those of this many most likely ids

    def logprob_fields(self) -> dict[str, Any]:
        return logprobs(self.logprobs is not None, self.logprobs, None)

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        if any(isinstance(p, str) for p in prompt) and tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        return [encode_prompt(tokenizer, p, chat=False) if isinstance(p, str) else list(p) for p in prompt]


@with_fields({"prompt_cache_breakpoint": dict[str, Any] | None})  # a prompt-cache hint: no prompt cache here
class TextPart(_Strict):
    type: Literal["text"]
    text: str


@with_fields(neutral_only({"tool_calls": (None, []), "function_call": NULL, "audio": NULL, "refusal": NULL}))
class ChatMessage(_Strict):
    """A message; name and tool_call_id go to the chat template with role and content."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        extra = {k: v for k in ("name", "tool_call_id") if (v := getattr(self, k)) is not None}
        return {"role": self.role, "content": content} | extra


@with_fields(CHAT_METADATA, neutral_only(CHAT_UNSUPPORTED))
class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: NonNegInt | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # OpenAI's bounds

    def logprob_fields(self) -> dict[str, Any]:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return logprobs(self.logprobs, self.top_logprobs, None)

    def length(self) -> tuple[str, int | None]:
        return synonym({"max_completion_tokens": self.max_completion_tokens, "max_tokens": self.max_tokens})

    def prompt(self, tokenizer: Any) -> list[int]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use /v1/completions or /generate")
        try:
            return apply_chat_template(tokenizer, Prompt(id="chat", dataset="chat",
                                                         messages=[m.as_dict() for m in self.messages]))
        except Exception as err:  # the template itself rejects the conversation (e.g. role order)
            raise ValueError(f"the chat template rejected the messages: {err}") from err
