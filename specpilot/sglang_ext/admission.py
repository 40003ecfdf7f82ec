"""What a SPECPILOT server refuses as a request arrives, and why.

The worker decides tokens from the target's plain distribution (accept.py): logprobs, hidden states, grammars,
logit bias, custom logit processors, penalties and min_new_tokens are not carried over to its verify rows.
SGLang's scheduler runs the worker inside its event loop, where an exception stops the whole server, so such a
request is aborted at admission instead (plugin.refuse_unsupported), with HTTP 400 and the reason — as SGLang
aborts what its own DFlash worker cannot serve. Nothing here imports SGLang: `req` is its schedule_batch.Req.
"""

from __future__ import annotations

from typing import Any

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def refusal(req: Any) -> str | None:
    """Why SPECPILOT cannot serve `req`, or None when it can."""
    p = req.sampling_params
    asked = [feature for feature, on in (
        ("logprobs", req.return_logprob),
        ("hidden states", req.return_hidden_states),
        ("a grammar (json_schema, regex, ebnf or structural_tag)", any(getattr(p, f) for f in GRAMMAR_FIELDS)),
        ("logit_bias", p.logit_bias is not None),
        ("a custom logit processor", req.custom_logit_processor is not None),
        ("frequency, presence or repetition penalties",
         p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0),
        ("min_new_tokens", p.min_new_tokens > 0),
    ) if on]
    if not asked:
        return None
    return (f"--speculative-algorithm SPECPILOT decides tokens from the target's plain distribution: it does not "
            f"take {', '.join(asked)} yet")
