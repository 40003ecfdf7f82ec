"""Request bodies of the HTTP APIs and their translation into prompts and SamplingParams.

Models are strict (no "5" for 5, no true for 1) so that a wrong type is a 400 naming the field rather
than a silent coercion. The SGLang API forbids unknown keys (an unsupported sampling option must not be
silently ignored); the OpenAI API ignores them, as OpenAI-compatible servers do, but rejects values of
known options that this server cannot honour (n > 1, penalties, logprobs).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specpilot.bench.datasets import Prompt, apply_chat_template
from specpilot.cli import encode_prompt
from specpilot.config import SamplingParams

# SGLang's treatment of tiny temperatures: below this, sampling is greedy (dividing logits by ~1e-40
# would overflow to inf and poison the softmax).
GREEDY_TEMPERATURE = 1e-6

Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1, description="torch generator seed")]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(description="token ids")]
NonNegInt = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _strings(value: str | list[str] | None) -> list[str] | None:
    return [value] if isinstance(value, str) else value


def sampling_params(fields: dict[str, Any], vocab_size: int) -> SamplingParams:
    """SamplingParams from the keys a client set (the rest keep SamplingParams' defaults).
    Raises ValueError naming the offending field."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if 0 < fields.get("temperature", 0) < GREEDY_TEMPERATURE:
        fields["temperature"] = 0.0
    bad = [t for t in fields.get("stop_token_ids", []) if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must lie in [0, {vocab_size}), got {bad}")
    return SamplingParams(**fields)


class _SamplingKnobs(BaseModel):
    """The sampling keys both APIs spell the same way (SamplingParams' names)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None

    def knobs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SamplingKnobs.model_fields} | {"stop": _strings(self.stop)}


# ---- SGLang /generate -----------------------------------------------------------------------------
class GenerateSampling(_Strict, _SamplingKnobs):
    """SGLang's sampling_params keys that the engine implements. Unset keys use the engine's
    defaults (max_new_tokens 128, greedy)."""

    max_new_tokens: NonNegInt | None = None
    min_new_tokens: NonNegInt | None = None

    def to_params(self, vocab_size: int) -> SamplingParams:
        return sampling_params(self.knobs() | {"max_new_tokens": self.max_new_tokens,
                                               "min_new_tokens": self.min_new_tokens}, vocab_size)


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSampling | list[GenerateSampling] | None = None
    rid: str | list[str] | None = None
    stream: bool = False

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

    def params(self, vocab_size: int) -> list[SamplingParams]:
        sp = self.sampling_params
        per_item = sp if isinstance(sp, list) else [sp or GenerateSampling()] * self.batch_size
        return [p.to_params(vocab_size) for p in per_item]

    def rids(self) -> list[str | None]:
        return self.rid if isinstance(self.rid, list) else [self.rid] * self.batch_size


# ---- OpenAI-compatible ----------------------------------------------------------------------------
class StreamOptions(_Lenient):
    include_usage: bool = False


class OpenAISampling(_Lenient, _SamplingKnobs):
    """Fields shared by /v1/completions and /v1/chat/completions. Defaults are OpenAI's (temperature
    None means 1); top_k, min_p, ignore_eos, min_tokens and stop_token_ids are SGLang extensions."""

    model: str | None = None
    max_tokens: NonNegInt | None = None
    min_tokens: NonNegInt | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | int | None = None

    def to_params(self, prompt_len: int, context_length: int, vocab_size: int) -> SamplingParams:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per prompt), got {self.n}")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (speculative decoding here is lossless for "
                                 "plain sampling only)")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        # without max_tokens, generate until a stop or the end of the context (as OpenAI does)
        max_tokens = self.max_tokens if self.max_tokens is not None else max(context_length - prompt_len, 0)
        temperature = 1.0 if self.temperature is None else self.temperature
        return sampling_params(self.knobs() | {"max_new_tokens": max_tokens, "min_new_tokens": self.min_tokens,
                                               "temperature": temperature}, vocab_size)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: NonNegInt | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        if self.echo or self.suffix or self.best_of not in (None, 1):
            raise ValueError("echo, suffix and best_of are not supported")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        if any(isinstance(p, str) for p in prompt) and tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        return [encode_prompt(tokenizer, p, chat=False) if isinstance(p, str) else list(p) for p in prompt]


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]

    def prompt(self, tokenizer: Any) -> list[int]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use /v1/completions or /generate")
        try:
            return apply_chat_template(tokenizer, Prompt(id="chat", dataset="chat",
                                                         messages=[m.as_dict() for m in self.messages]))
        except Exception as err:  # the template itself rejects the conversation (e.g. role order)
            raise ValueError(f"the chat template rejected the messages: {err}") from err
