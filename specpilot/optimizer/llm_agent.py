"""The LLM coding agent: reads the ranked gaps and the source behind the largest, asks any OpenAI-compatible
chat endpoint for a mechanism variant as a patch, checks that the patch applies in its own sandbox (asking again
with the error where it does not) and hands it to the orchestrator for the sealed evaluator. Every exchange -
prompt, response, patch, error - is kept for the memory. It runs in a process of its own, like the search
agents, and sees neither the evaluator's prompts nor its code."""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specpilot.optimizer.sandbox import PatchError, installed_package, make_sandbox

# the source an agent is shown for a gap (paths inside the package)
GAP_SOURCES: dict[str, list[str]] = {
    "verify": ["engine/step.py"],
    "draft": ["drafters/dflash.py"],
    "acceptance (tau)": ["drafters/ngram_assist.py"],
    "host and overhead": ["engine/step.py"],
}
DEFAULT_SOURCES = ["engine/step.py"]
MAX_SOURCE_CHARS = 24_000
ENV = {"base_url": "SPECPILOT_LLM_BASE_URL", "model": "SPECPILOT_LLM_MODEL", "api_key": "SPECPILOT_LLM_API_KEY"}
REQUEST_TIMEOUT_S = 600.0

SYSTEM = (
    "You improve the speed of a lossless speculative-decoding engine. Output must stay bit-identical to "
    "autoregressive decoding: change how fast tokens are produced, never which tokens. Answer with one change as "
    "a unified diff in a ```diff block (paths like a/specpilot/engine/step.py and b/specpilot/engine/step.py), "
    'or as JSON {"file": "specpilot/...", "find": "exact existing text", "replace": "new text"}.'
)


@dataclass
class Endpoint:
    base_url: str
    model: str
    api_key: str | None = None

    @classmethod
    def resolve(cls, base_url: str | None, model: str | None, api_key: str | None = None) -> Endpoint | None:
        """From flags, else the environment (SPECPILOT_LLM_*); None where no base URL is given either way."""
        base_url = base_url or os.environ.get(ENV["base_url"])
        if not base_url:
            return None
        return cls(base_url.rstrip("/"), model or os.environ.get(ENV["model"]) or "default",
                   api_key or os.environ.get(ENV["api_key"]))

    def chat(self, messages: list[dict[str, str]], max_tokens: int, transport: httpx.BaseTransport | None = None) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        base = self.base_url if self.base_url.endswith("/v1") else f"{self.base_url}/v1"
        with httpx.Client(transport=transport, timeout=REQUEST_TIMEOUT_S) as client:
            response = client.post(f"{base}/chat/completions", headers=headers,
                                   json={"model": self.model, "messages": messages, "temperature": 0,
                                         "max_tokens": max_tokens})
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"] or ""


@dataclass
class LlmBrief:
    """What the LLM agent is told."""

    endpoint: dict[str, Any]
    gaps: list[dict[str, Any]]  # ranked, largest lost speedup first
    profile: dict[str, Any]  # the profile the patch is evaluated under (the current best)
    attempts: int = 3
    max_tokens: int = 1024
    source_chars: int = MAX_SOURCE_CHARS  # of each file shown (an endpoint's context may be short)


@dataclass
class Exchange:
    prompt: list[dict[str, str]]
    response: str
    patch: str
    error: str | None = None


@dataclass
class LlmProposal:
    patch: str  # the last patch extracted ("" where no response held one); the evaluator judges it
    profile: dict[str, Any]
    applies: bool  # whether it applied in the agent's sandbox
    exchanges: list[Exchange] = field(default_factory=list)


def sources_for(gaps: list[dict[str, Any]], package: Path, chars: int = MAX_SOURCE_CHARS) -> dict[str, str]:
    """The files behind the largest gap (each cut to `chars`), as the repository paths a patch names."""
    names = GAP_SOURCES.get(gaps[0]["name"], DEFAULT_SOURCES) if gaps else DEFAULT_SOURCES
    return {f"specpilot/{n}": (package / n).read_text()[:chars] for n in names}


def prompt_for(gaps: list[dict[str, Any]], sources: dict[str, str]) -> list[dict[str, str]]:
    table = "\n".join(f"- {g['name']}: {g['measured']:.3f} ms measured, {g['best']:.3f} ms floor, costs "
                      f"{g['lost_speedup']:.3f}x of speedup" for g in gaps) or "- (no gap measured)"
    files = "\n\n".join(f"### {path}\n```python\n{text}\n```" for path, text in sources.items())
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"The step's gaps to its floor, largest first:\n{table}\n\nThe source behind "
                                        f"the largest:\n\n{files}\n\nPropose one change that closes part of it."}]


def extract_patch(response: str, sources: dict[str, str]) -> str:
    """A unified diff from the response: its ```diff block, else its find/replace JSON (on text of a file it
    was shown) made into one; "" where it holds neither."""
    block = re.search(r"```(?:diff|patch)\s*\n(.*?)```", response, re.S)
    if block and "+++ " in block.group(1):
        text = block.group(1)
        return text if text.endswith("\n") else text + "\n"
    found = re.search(r"\{.*\}", response, re.S)
    if not found:
        return ""
    try:
        edit = json.loads(found.group(0))
        path, old, new = edit["file"], edit["find"], edit["replace"]
    except (ValueError, KeyError, TypeError):
        return ""
    shown = sources.get(path)
    if shown is None or not isinstance(old, str) or not old or old not in shown or not isinstance(new, str):
        return ""
    source = (installed_package() / path.removeprefix("specpilot/")).read_text()  # the whole file, not the cut
    changed = source.replace(old, new, 1)
    return "".join(difflib.unified_diff(source.splitlines(True), changed.splitlines(True), f"a/{path}", f"b/{path}"))


def propose(brief: LlmBrief, sandbox: Path, transport: httpx.BaseTransport | None = None) -> LlmProposal:
    """Ask, extract, check in the sandbox; with the error on failure, ask again (`attempts` in all)."""
    endpoint = Endpoint(**brief.endpoint)
    sources = sources_for(brief.gaps, installed_package(), brief.source_chars)
    messages = prompt_for(brief.gaps, sources)
    exchanges: list[Exchange] = []
    patch = ""
    for _ in range(brief.attempts):
        try:
            response = endpoint.chat(messages, brief.max_tokens, transport)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:  # unreachable, or not a chat answer
            exchanges.append(Exchange(list(messages), "", "", f"the endpoint failed: {err}"))
            break
        patch = extract_patch(response, sources)
        error = None
        try:
            if not patch:
                raise PatchError("no unified diff or find/replace JSON in the answer")
            make_sandbox(sandbox, patch)
        except PatchError as err:
            error = str(err)
        exchanges.append(Exchange(list(messages), response, patch, error))
        if error is None:
            return LlmProposal(patch, brief.profile, True, exchanges)
        messages = [*messages, {"role": "assistant", "content": response[:2000]},  # short: the context may be
                    {"role": "user", "content": f"That change cannot be used: {error}. Answer again with one "
                                                "change in the format asked for."}]
    return LlmProposal(patch, brief.profile, False, exchanges)


def run_agent(brief_path: str) -> None:
    """The LLM agent's process: its brief from its sandbox, its proposal written beside it."""
    path = Path(brief_path)
    brief = LlmBrief(**json.loads(path.read_text()))
    proposal = propose(brief, path.parent / "tree")
    (path.parent / "proposal.json").write_text(json.dumps(asdict(proposal)))
