"""SGLang's server arguments for `--speculative-algorithm SPECPILOT`: what our worker supports, checked and
resolved once.

SGLang calls `validate` (our validate_server_args) and then our algorithm's handle_server_args (`apply`)
from ServerArgs.__post_init__ (arg_groups/speculative_hook.py), after it resolved the model, the page size
and the attention backends. Fields SGLang's override pipeline may still be declaring are read through its
resolved view, as its own per-algorithm handlers read them. Every error names the flag to change.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

from specpilot.drafters.dflash_model import DFlashConfig, read_dflash_config
from specpilot.drafters.draft_tree import MAX_TREE_NODES
from specpilot.engine.registry import TUNABLES

logger = logging.getLogger(__name__)

# Backends whose TARGET_VERIFY pass takes a custom tree mask (SGLang's NGRAM verify input), which we verify with
VERIFY_BACKENDS = ("flashinfer", "triton")
# SGLang has no flag for n-gram assist (prompt lookup merged into the drafts): the environment carries it
NGRAM_ASSIST_ENV = "SPECPILOT_NGRAM_ASSIST"
# SGLang's default for every speculative algorithm (arg_groups/speculative_hook.py)
MAX_RUNNING_REQUESTS = 48

_TUNABLE = {t.name: t for t in TUNABLES}


@dataclass(frozen=True)
class Settings:
    draft_path: Path
    drafter: DFlashConfig
    block_size: int  # verify width: the newest committed token and block_size - 1 drafts
    topk: int  # 1: a chain; more: a draft tree of block_size - 1 nodes from each slot's top-k
    ngram_assist: int
    # SGLang's --enable-deterministic-inference: its sampler draws keyed by each request's seed and position, so
    # the worker samples every verify row with it (sampled output SGLang AR's); else our keyed sampling
    deterministic: bool = False


def resolve(server_args: Any) -> Settings:
    """Our worker's settings from SGLang's server arguments; ValueError naming the flag when unsupported."""
    draft_path, drafter = _drafter(server_args)
    _check_target(server_args, drafter)
    block = _block_size(server_args, drafter)
    topk = 1 if server_args.speculative_eagle_topk is None else server_args.speculative_eagle_topk
    tree_topk = _TUNABLE["tree-topk"]
    if not tree_topk.valid(topk):
        raise ValueError(f"--speculative-eagle-topk (SPECPILOT's tree top-k) must be {tree_topk.domain}, got {topk!r}")
    if topk > 1 and block - 1 > MAX_TREE_NODES:
        raise ValueError(f"--speculative-eagle-topk {topk} drafts a tree of --speculative-num-draft-tokens - 1 "
                         f"nodes, at most {MAX_TREE_NODES}; got {block}")
    if server_args.speculative_num_steps not in (None, 1):
        raise ValueError("SPECPILOT drafts its whole block in one pass: leave --speculative-num-steps unset, "
                         f"got {server_args.speculative_num_steps}")
    _check_parallelism_and_backends(server_args, topk)
    return Settings(draft_path, drafter, block, topk, _ngram_assist(),
                    bool(getattr(server_args, "enable_deterministic_inference", False)))


def validate(server_args: Any) -> None:
    resolve(server_args)


def apply(server_args: Any) -> None:
    """Write the resolved settings where SGLang's scheduler and KV accounting read them."""
    settings = resolve(server_args)
    server_args.speculative_num_draft_tokens = settings.block_size
    server_args.speculative_eagle_topk = settings.topk
    server_args.speculative_num_steps = 1
    if not server_args.disable_overlap_schedule:
        # the worker verifies synchronously; SGLang refuses an algorithm without overlap support otherwise
        server_args.disable_overlap_schedule = True
        logger.warning("SPECPILOT does not support overlap scheduling yet: --disable-overlap-schedule is set.")
    if not server_args.disable_radix_cache:
        # our drafter keeps its own context per request, written from the taps of what the target ran: a prefix
        # the radix cache serves would reach it without them
        server_args.disable_radix_cache = True
        logger.warning("SPECPILOT's drafter keeps its own context per request: --disable-radix-cache is set.")
    if server_args.enable_mixed_chunk:
        server_args.enable_mixed_chunk = False
        logger.warning("Mixed chunked prefill is disabled because of SPECPILOT speculative decoding.")
    if server_args.max_running_requests is None:
        server_args.max_running_requests = MAX_RUNNING_REQUESTS
    verify, flag = _verify_backend(server_args)
    if settings.deterministic and verify != "triton":
        # decode_rows.py: only the Triton backend verifies each row as SGLang's decode computes it
        logger.warning("SPECPILOT matches SGLang AR bit for bit under --enable-deterministic-inference only with "
                       "%s triton; with %s its verify rows can round differently from decode at near-ties.", flag,
                       verify)


def _drafter(server_args: Any) -> tuple[Path, DFlashConfig]:
    flag = "--speculative-draft-model-path"
    what = ("a SpecPilot DFlash checkpoint directory (config.json with architectures DFlashDraftModel and "
            "its dflash_config, model.safetensors)")
    if server_args.speculative_draft_model_path is None:
        raise ValueError(f"SPECPILOT needs {flag}: {what}")
    path = Path(server_args.speculative_draft_model_path)
    if not path.is_dir():
        raise ValueError(f"{flag} {path} is not a directory; SPECPILOT needs {what}")
    try:
        drafter = read_dflash_config(path)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{flag} {path} is not {what}: {err!r}") from None
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{flag} {path} has no model.safetensors; SPECPILOT needs {what}")
    return path, drafter


def _check_target(server_args: Any, drafter: DFlashConfig) -> None:
    """The drafter reads the target's hidden states at its layers and embeds with the target's embeddings."""
    target = server_args.get_model_config().hf_text_config
    why = None
    if drafter.layers.hidden_size != target.hidden_size:
        why = f"its hidden size {drafter.layers.hidden_size} is not the target's {target.hidden_size}"
    elif any(not 0 <= i < target.num_hidden_layers - 1 for i in drafter.target_layer_ids):
        # SGLang captures layer i's output as layer i + 1's input: the last layer's is out of its reach
        why = (f"its target_layer_ids {drafter.target_layer_ids} must be below the target's last layer "
               f"({target.num_hidden_layers - 1})")
    elif not 0 <= drafter.mask_token_id < target.vocab_size:
        why = f"its mask_token_id {drafter.mask_token_id} is outside the target's vocabulary of {target.vocab_size}"
    if why is not None:
        raise ValueError(f"--speculative-draft-model-path {server_args.speculative_draft_model_path} does not "
                         f"fit --model-path {server_args.model_path}: {why}")


def _block_size(server_args: Any, drafter: DFlashConfig) -> int:
    block, alias = server_args.speculative_num_draft_tokens, server_args.speculative_dflash_block_size
    if block is not None and alias is not None and block != alias:
        raise ValueError(f"--speculative-num-draft-tokens ({block}) and --speculative-dflash-block-size ({alias}) "
                         "both set the block size and differ")
    block = block if block is not None else alias if alias is not None else drafter.block_size
    if not (_TUNABLE["block-size"].valid(block) and block <= drafter.block_size):
        # a block longer than the drafter was trained on drafts slots it never learned
        raise ValueError(f"--speculative-num-draft-tokens (the block size) must be 2..{drafter.block_size}, the "
                         f"drafter's trained block, got {block!r}")
    return block


def _check_parallelism_and_backends(server_args: Any, topk: int) -> None:
    view = resolved_view(server_args)
    if server_args.pp_size != 1:
        raise ValueError(f"SPECPILOT supports --pp-size 1 only, got {server_args.pp_size}")
    if view.enable_dp_attention:
        raise ValueError("SPECPILOT does not support --enable-dp-attention")
    verify, flag = _verify_backend(server_args)
    if verify not in VERIFY_BACKENDS:
        raise ValueError(f"SPECPILOT verifies with a tree mask: set {flag} to one of {', '.join(VERIFY_BACKENDS)} "
                         f"(the verify pass's backend is {verify!r})")
    if topk > 1 and (view.page_size or 1) > 1 and verify != "flashinfer":
        # SGLang's paged backends other than flashinfer mis-verify trees (its NGRAM check, speculative_hook.py)
        raise ValueError(f"draft trees (--speculative-eagle-topk {topk}) with --page-size {view.page_size} need the "
                         f"flashinfer attention backend, not {verify!r}; or use --page-size 1")


def _verify_backend(server_args: Any) -> tuple[str, str]:
    """(the attention backend of SGLang's verify pass, the flag that sets it)."""
    view = resolved_view(server_args)
    prefill, decode = attention_backends_of(view)
    # SGLang's verify pass takes the decode backend under --speculative-attention-mode decode, else the prefill one
    phase = "decode" if view.speculative_attention_mode == "decode" else "prefill"
    flag = f"--{phase}-attention-backend" if getattr(view, f"{phase}_attention_backend") else "--attention-backend"
    return (decode if phase == "decode" else prefill), flag


def _ngram_assist() -> int:
    assist = _TUNABLE["ngram-assist"]
    raw = os.environ.get(NGRAM_ASSIST_ENV)
    if raw is None:
        return assist.default("cuda", "dflash")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if not assist.valid(value):
        raise ValueError(f"{NGRAM_ASSIST_ENV} must be {assist.domain}, got {raw!r}")
    return value
