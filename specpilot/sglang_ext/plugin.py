"""SGLang's entry point: `register` (group sglang.srt.plugins in pyproject.toml) adds the speculative
algorithm SPECPILOT to SGLang's registry (speculative/spec_info.py SpeculativeAlgorithm.register).

SGLang's load_plugins() calls it once in every process and logs and swallows what it raises, so a broken
plugin shows as `Unknown speculative algorithm name: SPECPILOT`, with the cause earlier in the log.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.speculative.spec_info import CustomSpecAlgo, SpeculativeAlgorithm

from specpilot.sglang_ext import args

NAME = "SPECPILOT"


class SpecPilotAlgorithm(CustomSpecAlgo):
    """What SGLang's scheduler and KV accounting ask of an algorithm, answered for ours."""

    def has_draft_kv(self) -> bool:
        # our drafter's K/V live in its own cache: SGLang's pool holds only the verify block, as for NGRAM
        return False

    def handle_server_args(self, server_args: Any) -> None:
        args.apply(server_args)


def register() -> None:
    SpeculativeAlgorithm.register(NAME, supports_overlap=False, validate_server_args=args.validate,
                                  spec_class=SpecPilotAlgorithm)(_worker_class)


def _worker_class(server_args: Any) -> type:
    # imported when SGLang builds its workers: the worker module pulls in SGLang's scheduler and model code
    from specpilot.sglang_ext.worker import SpecPilotWorker

    return SpecPilotWorker
