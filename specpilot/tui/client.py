"""A client of a running `specpilot serve` (or any SGLang-compatible server): its state from
/get_server_info, and a streamed /generate whose chunks carry each token's origin."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class ServerState:
    """One poll of /get_server_info, in the fields the app draws."""

    throughput: float
    accept_length: float
    running: int
    waiting: int
    histogram: list[int] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=dict)  # draft / verify / other, summed over steps
    model: str = ""
    algorithm: str | None = None

    @classmethod
    def parse(cls, info: dict[str, Any]) -> ServerState:
        state = (info.get("internal_states") or [{}])[0]
        spec = state.get("spec_stats") or {}
        return cls(throughput=float(state.get("last_gen_throughput") or 0.0),
                   accept_length=float(state.get("avg_spec_accept_length") or 0.0),
                   running=int(info.get("running_requests") or 0), waiting=int(info.get("waiting_requests") or 0),
                   histogram=list(spec.get("accept_histogram") or []), time_s=dict(spec.get("time_s") or {}),
                   model=str(info.get("served_model_name") or info.get("model_path") or ""),
                   algorithm=info.get("speculative_algorithm"))


@dataclass
class Chunk:
    """A streamed chunk: the ids so far, and how each came where the server says (else empty)."""

    ids: list[int]
    origins: list[str]
    texts: list[str]  # each id's own text, where the server gives it (else empty)
    text: str
    finished: bool


class ServerClient:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def state(self) -> ServerState:
        response = self.http.get("/get_server_info")
        response.raise_for_status()
        return ServerState.parse(response.json())

    def stream(self, prompt: str, max_new_tokens: int) -> Iterator[Chunk]:
        body = {"text": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        with self.http.stream("POST", "/generate", json=body, timeout=None) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"/generate answered {response.status_code}: {response.text[:200]}")
            origins: list[str] = []  # each chunk says only how its new ids came: gathered here
            texts: list[str] = []
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                meta = data.get("meta_info") or {}
                origins += meta.get("new_token_origins") or []
                texts += meta.get("new_token_texts") or []
                yield Chunk(list(data.get("output_ids") or []), list(origins), list(texts), data.get("text", ""),
                            meta.get("finish_reason") is not None)
