"""`specpilot` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specpilot.optimizer.significance import min_pairs
from specpilot.optimizer.verdicts import REPEATS
from specpilot.tui import launch as tui_launch

if TYPE_CHECKING:
    from specpilot.engine.config import EngineConfig

DEFAULT_PROMPT = "Write a haiku about the sea."
# optimize's evaluation workload by device, (prompts, new tokens per prompt): a CPU decodes the embedded model
# at ~100 ms a token, so 2 rounds of 2 agents fit in 15 minutes only with short runs (docs/RESULTS.md)
OPTIMIZE_WORKLOAD = {"cuda": (3, 128), "cpu": (2, 24)}


def _engine_args(p: argparse.ArgumentParser) -> None:
    from specpilot.drafters import ALGORITHMS
    from specpilot.engine.config import EngineConfig

    g = p.add_argument_group("model and engine")
    g.add_argument("--model-path", default=None,
                   help="GGUF file or Hugging Face directory (config.json + safetensors); default: the embedded "
                        "SmolLM2-135M-Instruct")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--context-length", type=_positive_int, default=None,
                   help="KV positions a request may reach (default: 4096 on CUDA, 2048 on CPU, at most the model's)")
    g.add_argument("--max-running-requests", type=_positive_int, default=None,
                   help="requests decoded together (default: 32 on CUDA, 64 on CPU; generate: 1; bench: "
                        "--batch-size); admitted while the KV pool has pages for their prompt and new tokens")
    g.add_argument("--max-total-tokens", type=_positive_int, default=None,
                   help="KV pool's positions, all requests together (default: every request's "
                        "--context-length within the memory; on CPU 16384)")
    g.add_argument("--page-size", type=_page_size, default=EngineConfig.page_size, metavar="N",
                   help="KV pool's positions per page, a power of two; a request's pages round its positions up "
                        f"to it (default {EngineConfig.page_size}: one key tile of the invariant attention)")
    g.add_argument("--mem-fraction-static", type=_fraction, default=None,
                   help="share of the device's memory for the weights and the KV pool together (default: the KV "
                        "pool takes 60%% of the memory free after loading on CUDA, 25%% on CPU)")
    g.add_argument("--max-prefill-tokens", type=_positive_int, default=None,
                   help=f"prompt tokens admitted in one prefill pass (default {EngineConfig.max_prefill_tokens})")
    g.add_argument("--min-prefill-batch", type=_positive_int, default=None, metavar="N",
                   help="while requests run, admit waiting ones only once N slots are free (or all of them fit), "
                        f"so prefills come in waves (default {EngineConfig.min_prefill_batch})")
    g.add_argument("--prefill-graph-tokens", type=_nonneg_int, default=None, metavar="N",
                   help="CUDA: prefill passes of up to 8 prompts and N prompt tokens replay a CUDA graph (an eager "
                        f"pass is launch-bound); 0: eager prefills (default {EngineConfig.prefill_graph_tokens})")
    g.add_argument("--admission", choices=["eager", "coalesce"], default=None,
                   help="while requests run, waiting ones join as soon as a slot is free (eager), or once the free "
                        "slots' idle time outweighs what a prefill pass stalls the batch for (coalesce: fewer "
                        f"passes under load, TTFT a pass or so later; default {EngineConfig.admission})")
    g.add_argument("--disable-cuda-graph", dest="cuda_graphs", action="store_false", default=None,
                   help="run decode eagerly on CUDA")
    g.add_argument("--disable-tuned-tiles", dest="tuned_tiles", action="store_false", default=True,
                   help="launch the GEMMs on their untuned tiles even where `bench --tune-gemm-tiles` cached this "
                        "device's (the same tokens either way)")
    g.add_argument("--cuda-graph-bs", dest="cuda_graph_batch_sizes", type=_positive_int, nargs="+", default=None,
                   metavar="BS", help="batch sizes captured as CUDA graphs (default: "
                                      f"{' '.join(map(str, EngineConfig.cuda_graph_batch_sizes))})")
    g.add_argument("--attention-kv-splits", type=_nonneg_int, default=None, metavar="N",
                   help="key splits of decode and verify attention with --no-batch-invariant (the invariant "
                        "kernel splits by key position); 0: the kernel's choice per batch (default)")
    g.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false", default=True,
                   help="CUDA: the fastest kernel per pass instead of the batch-invariant ones (speculation then "
                        "matches AR only up to float rounding, and forcing is statistical)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-algorithm", default=None, type=str.lower, choices=["none", *ALGORITHMS],
                   help="drafter; default: serve and generate on the embedded model: dflash (its shipped "
                        "drafter), else none (plain AR decoding)")
    s.add_argument("--speculative-draft-model-path", default=None,
                   help="DFlash checkpoint directory or PARD model directory; DFlash on the embedded model: "
                        "the shipped drafter")
    s.add_argument("--speculative-num-draft-tokens", type=_at_least_two, default=None,
                   help="tokens per verify pass (block size: newest token + drafts); default from the drafter "
                        "(DFlash chains on CPU: at most 4)")
    s.add_argument("--speculative-ngram-assist", type=_nonneg_int, default=None, metavar="N",
                   help="dflash/pard: where the context's last N+ tokens occurred before, draft what followed them "
                        "(prompt lookup) instead of the model's block; 0: off (default: 2 for dflash, else 0)")
    s.add_argument("--speculative-eagle-topk", type=_positive_int, default=None, metavar="K",
                   help="dflash: K > 1 verifies a draft tree instead of a chain: the likeliest paths through "
                        "each slot's top-K tokens, as many nodes as the block has drafts; 1: chain (default: 4 "
                        "on CUDA, 1 on CPU)")
    s.add_argument("--speculative-lookup-prob", type=float, default=None, metavar="P",
                   help="dflash trees with --speculative-ngram-assist: the probability prompt lookup's tokens "
                        f"enter the tree at (default {EngineConfig.speculative_lookup_prob})")
    r = p.add_argument_group("speed settings (specpilot registry lists them)")
    r.add_argument("--mechanisms", default=None, metavar="LIST",
                   help="comma-separated mechanisms of the decode step (speculative, or AR's `overlap`), exactly "
                        "those; 'stock' for none; or +name / -name entries that add to or take from the defaults "
                        "(e.g. +budget; default: every one that applies, but those off unless named: `specpilot "
                        "registry`)")
    r.add_argument("--profile", default=None, metavar="FILE|NAME",
                   help='JSON {"mechanisms": [...] or "stock", "tunables": {name: value}}, or a shipped profile '
                        "by name (embedded-cuda, ...: the default of the embedded model's DFlash drafter); the "
                        "flags given win")


def _sampling_args(p: argparse.ArgumentParser, with_length: bool = True) -> None:
    g = p.add_argument_group("sampling")
    if with_length:
        g.add_argument("--max-new-tokens", type=_nonneg_int, default=128)
    g.add_argument("--min-new-tokens", type=_nonneg_int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="<= 0 disables")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=_nonneg_int, action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g = p.add_argument_group("structured output (at most one; TEXT or @FILE)")
    g.add_argument("--json-schema", type=_text_or_file, default=None, help="the output follows this JSON schema")
    g.add_argument("--regex", type=_text_or_file, default=None, help="the output matches this regex")
    g.add_argument("--ebnf", type=_text_or_file, default=None, help="the output follows this EBNF grammar")


def _text_or_file(value: str) -> str:
    """An argparse type: the text itself, or @PATH for a file's."""
    if not value.startswith("@"):
        return value
    try:
        return pathlib.Path(value[1:]).read_text()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {err.strerror}") from err


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum (the error names the flag)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value
    return parse


_positive_int, _nonneg_int, _at_least_two = _int_at_least(1), _int_at_least(0), _int_at_least(2)


def _page_size(text: str) -> int:
    """An argparse type: a positive power of two (the KV pool's positions per page)."""
    from specpilot.state.pages import valid_page_size

    value = int(text)
    if not valid_page_size(value):
        raise argparse.ArgumentTypeError(f"must be a positive power of two, got {text}")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from specpilot.drafters import ALGORITHMS

    parser = argparse.ArgumentParser(prog="specpilot", description="Lossless speculative decoding serving stack.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from the shell",
                         description="One-shot generation. Without --model-path the embedded default model is used.")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object {text, output_ids, meta_info}")
    gen.add_argument("--logprobs", type=_nonneg_int, default=None, metavar="N",
                     help="with --json: each output token's logprob and its N likeliest alternatives")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    force = sub.add_parser("force", help="token forcing of a configuration against stock AR (JSON verdict)",
                           description="Runs stock AR, then the configuration with stock's tokens forced, and "
                                       "checks every position. Exit code 1 when the verdict fails.")
    _dataset_args(force, default_prompts=8, default_tokens=64)
    _engine_args(force)
    _sampling_args(force, with_length=False)
    g = force.add_argument_group(
        "between two running servers (SGLang's /generate: SGLang with and without a speculative algorithm, or "
        "`specpilot serve`; no engine is built here)")
    g.add_argument("--reference-url", default=None, metavar="URL", help="the reference server, e.g. SGLang AR")
    g.add_argument("--candidate-url", default=None, metavar="URL", help="the server forced along the reference")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the prompts' tokenizer: a .gguf or a Hugging Face directory (default: --model-path's)")
    g.add_argument("--tie-band", type=float, default=0.0,
                   help="reference top-1 minus top-2 logprob at or under which a differing token is a tie (default 0)")
    force.set_defaults(func=_cmd_force)

    bench = sub.add_parser("bench", help="speedup over AR, tau and acceptance per dataset (JSON + PNG)")
    _dataset_args(bench, default_prompts=20, default_tokens=256, many=True)
    bench.add_argument("--batch-size", type=_positive_int, default=1, help="requests run together (default 1)")
    bench.add_argument("--batching", choices=("continuous", "waves"), default="continuous",
                       help="continuous: every prompt queued at once, a finished request's slot refilled at once "
                            "(default); waves: --batch-size prompts at a time, each wave waiting for its longest")
    bench.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                       help="runs of each mode per dataset, interleaved AR, speculative, AR, ...; the table shows "
                            "medians and ranges, the JSON every run (default 3)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--sampling-seed", type=int, default=None, metavar="S",
                       help="T > 0: request i samples with seed S + i in every run (default: a random S)")
    bench.add_argument("--output-dir", default=None,
                       help="folder for the JSON and PNG (default: a new specpilot-bench/<date>-<time>/)")
    _engine_args(bench)
    _serving_bench_args(bench)
    c = bench.add_argument_group("cost table (--profile-cost-table: the target's pass time by batch size and rows per "
                                 "request, kept on disk for this device and model)")
    c.add_argument("--profile-cost-table", action="store_true", help="measure the table instead of a benchmark")
    c.add_argument("--cost-batch-sizes", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32], metavar="B")
    c.add_argument("--cost-tokens", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32], metavar="T",
                   help="rows per request (a verify pass's block or tree)")
    c.add_argument("--cost-context", type=_positive_int, default=512,
                   help="positions already in each request's cache (default 512)")
    t = bench.add_argument_group("GEMM tiles (--tune-gemm-tiles: the decode and verify tiles of the target's weight "
                                 "shapes on this CUDA device, kept on disk and taken by every later engine here; "
                                 "never a token changed)")
    t.add_argument("--tune-gemm-tiles", action="store_true", help="tune the tiles instead of a benchmark")
    t.add_argument("--tile-kernels", nargs="+", choices=("bf16", "b12"), default=["bf16", "b12"],
                   help="the kernels to tune: bf16 weights, B12 weights (default both)")
    t.add_argument("--tile-rows", nargs="+", choices=("decode", "verify"), default=["decode", "verify"],
                   help="the products to tune: decode (1-64 rows), verify passes (65-512 rows) (default both)")
    bench.set_defaults(func=_cmd_bench)

    serve = sub.add_parser("serve", help="HTTP server: SGLang /generate and OpenAI-compatible /v1 APIs",
                           description="Serve the engine over HTTP (flags follow python -m sglang.launch_server). "
                                       "Without --model-path the embedded default model is served.")
    _engine_args(serve)
    h = serve.add_argument_group("HTTP server")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=_positive_int, default=30000)
    h.add_argument("--max-queued-requests", type=_nonneg_int, default=None,
                   help="requests that may wait for a running slot before new ones get 503 "
                        "(default 4 x --max-running-requests)")
    h.add_argument("--served-model-name", default=None, help="model name in the OpenAI API (default: the model path)")
    h.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted")
    h.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                   help="a stream's chunks after the first token: one per N new tokens at most (default 1; larger "
                        "spends less of the server's time per token under load)")
    h.add_argument("--single-process", action="store_true",
                   help="run the engine in the HTTP server's process (default: a process of its own, so HTTP, "
                        "detokenizing and streaming never hold up the engine's steps)")
    serve.add_argument("--engine-config", default=None, metavar="FILE",
                       help="the engine's whole config as JSON fields (as the optimizer's sealed evaluator writes "
                            "it); the engine flags above are then not read")
    serve.set_defaults(func=_cmd_serve)

    train = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (CPU or CUDA)",
                           description="Regenerates responses with the target, trains a DFlash drafter on its tap "
                                       "features and writes a checkpoint that --speculative-draft-model-path loads.")
    _train_drafter_args(train)
    train.set_defaults(func=_cmd_train_drafter)

    convert = sub.add_parser("convert", help="rewrite a checkpoint's weights in another format (B12: lossless)",
                             description="A Hugging Face model directory's projection and LM-head matrices as B12 "
                                         "(12 bits a bf16 weight, bit-exact); loading decodes them exactly.")
    convert.add_argument("--format", required=True, choices=["b12"], help="the weight format to write")
    convert.add_argument("--model-path", required=True, help="a Hugging Face model directory (safetensors)")
    convert.add_argument("--out", required=True, help="the directory to write the converted checkpoint to")
    convert.set_defaults(func=_cmd_convert)

    registry = sub.add_parser("registry", help="the settings that change speed but never output",
                              description="Every tunable (its flag, domain, default and the stages it changes) "
                                          "and every mechanism of the speculative step.")
    registry.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                          help="whose defaults to show (default: cuda if available)")
    registry.add_argument("--speculative-algorithm", default=None, type=str.lower, choices=["none", *ALGORITHMS],
                          help="the drafter whose defaults to show (default: none)")
    registry.add_argument("--json", action="store_true", help="print one JSON object {tunables, mechanisms}")
    registry.set_defaults(func=_cmd_registry)

    cost = sub.add_parser("costmodel", help="the device's ceilings, the step floors, the speedup ceiling and the gaps",
                          description="Calibrate the device, take the deployment's shapes and give each step's "
                                      "floor and the speedup ceiling; with --measure, the measured step breakdown "
                                      "and the gaps ranked by the speedup each costs (table, JSON, PNG).")
    _dataset_args(cost, default_prompts=4, default_tokens=64)
    cost.add_argument("--batch-size", type=_positive_int, default=1, help="requests per step (default 1)")
    cost.add_argument("--context", type=_positive_int, default=None,
                      help="tokens in each request's cache for the floors (default: the measured run's mean, else 512)")
    cost.add_argument("--measure", action="store_true", help="run the deployment to measure its step breakdown")
    cost.add_argument("--output-dir", default=None, help="folder for the JSON and PNG (default: specpilot-costmodel/)")
    _engine_args(cost)
    cost.set_defaults(func=_cmd_costmodel)

    opt = sub.add_parser("optimize", help="rounds of cost model, search agents and the sealed evaluator; a profile",
                         description="Each round: the cost model ranks the gaps of the best profile so far, "
                                     "--agents search agents propose profiles in their own processes, the sealed "
                                     "evaluator admits what forcing proves lossless and interleaved runs prove "
                                     "faster than stock; the memory (--db) records it all. Ends with a profile "
                                     "for --profile.")
    _dataset_args(opt, default_prompts=None, default_tokens=None,
                  help_prompts="default: %d on CUDA, %d on CPU" % (OPTIMIZE_WORKLOAD["cuda"][0],
                                                                 OPTIMIZE_WORKLOAD["cpu"][0]),
                  help_tokens="default: %d on CUDA, %d on CPU" % (OPTIMIZE_WORKLOAD["cuda"][1],
                                                                OPTIMIZE_WORKLOAD["cpu"][1]))
    opt.add_argument("--rounds", type=_nonneg_int, default=2,
                     help="rounds to run (0: with --resume --baseline, only the baseline for the rounds in memory)")
    opt.add_argument("--agents", type=_positive_int, default=2, help="search agents per round, each a process")
    opt.add_argument("--proposals-per-agent", type=_positive_int, default=1,
                     help="candidates each agent proposes per round (the round's evaluation budget)")
    opt.add_argument("--repeats", type=_positive_int, default=REPEATS,
                     help=f"interleaved timed pairs (stock, candidate) per candidate, at least {min_pairs()}: the "
                          f"paired test accepts only a speedup shown at p <= 0.05 (default {REPEATS})")
    opt.add_argument("--db", default=None, help="the memory file (default: ./specpilot-memory.db)")
    opt.add_argument("--resume", action="store_true",
                     help="go on from the best profile this deployment has in memory, after the last candidate judged")
    opt.add_argument("--llm-base-url", default=None,
                     help="an OpenAI-compatible endpoint for the LLM coding agent (default: $SPECPILOT_LLM_BASE_URL; "
                          "none: no LLM agent)")
    opt.add_argument("--llm-model", default=None, help="its model name (default: $SPECPILOT_LLM_MODEL, else 'default')")
    opt.add_argument("--llm-attempts", type=_positive_int, default=3,
                     help="answers the LLM agent may take per round to give a patch that applies (default 3)")
    opt.add_argument("--llm-source-chars", type=_positive_int, default=24_000,
                     help="characters of each source file the LLM agent is shown (fit the endpoint's context)")
    opt.add_argument("--baseline", action="store_true",
                     help="also judge as many random profiles as the loop did (the best-of-N baseline)")
    opt.add_argument("--output-dir", default=None,
                     help="rounds' reports and the profile (default: specpilot-optimize/)")
    _engine_args(opt)
    opt.set_defaults(func=_cmd_optimize)

    tui = sub.add_parser("tui", help="the terminal app: rounds, the memory, a server",
                         description=tui_launch.DESCRIPTION)
    tui_launch.add_arguments(tui)
    tui.set_defaults(func=tui_launch.run)

    memory = sub.add_parser("memory", help="the optimizer's memory: deployments, rounds, candidates, verdicts",
                            description="Read the optimizer's SQLite memory (it also opens in datasette or the "
                                        "sqlite3 shell: see the candidate_results view).")
    memory.add_argument("action", choices=["list", "show", "export", "diff"],
                        help="list: every round; show ROUND; export: every table as JSON; diff ROUND ROUND")
    memory.add_argument("rounds", nargs="*", type=int, metavar="ROUND", help="round ids (show: one, diff: two)")
    memory.add_argument("--db", default=None, help="the memory file (default: ./specpilot-memory.db)")
    memory.set_defaults(func=_cmd_memory)
    for command in sub.choices.values():
        command.add_argument("--log-level", default=None, type=str.upper,
                             choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                             help="default: WARNING for generate, INFO for the other commands")
    return parser


def _train_drafter_args(p: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from specpilot.bench.datasets import TRAIN_DATASETS
    from specpilot.training.train import TrainConfig

    defaults = {f.name: f.default for f in fields(TrainConfig)}

    def add(group: argparse._ArgumentGroup, flag: str, help: str, **kw) -> None:
        dest = flag[2:].replace("-", "_")
        value = defaults[dest]
        if value is not None and value is not False:
            help += f" (default: {' '.join(value) if isinstance(value, tuple) else value})"
        group.add_argument(flag, dest=dest, default=value, help=help, **kw)

    g = p.add_argument_group("target and data")
    g.add_argument("--target", default="default",
                   help="target GGUF file or HF directory, or 'default' (the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--out", required=True, help="output directory: checkpoint, data.pt, trainer_state.pt")
    add(g, "--datasets", "train splits whose prompts are trained on: first user turns; sharegpt-turns: ShareGPT's "
                         "later user turns with the conversation before them", nargs="+", choices=TRAIN_DATASETS)
    add(g, "--num-prompts", "prompts, split evenly across --datasets", type=_positive_int)
    add(g, "--validation-prompts", "held-out prompts (the next ones of each train split) whose responses "
                                   "measure tau after every epoch; 0: none", type=_nonneg_int)
    add(g, "--max-new-tokens", "response tokens the target generates per prompt", type=_positive_int)
    add(g, "--responses-per-prompt", "responses the target writes per prompt: its greedy one, the rest sampled at "
                                     "--response-temperature (more data from the same prompts)", type=_positive_int)
    add(g, "--response-temperature", "temperature of the sampled responses", type=float)
    add(g, "--reuse-responses", "an earlier run's data.pt (same target, --max-new-tokens, --max-seq-len): the greedy "
                                "responses of the prompts it holds are taken from it, the others generated")
    add(g, "--max-seq-len", "prompt + response tokens at most", type=_positive_int)
    add(g, "--gen-batch-size", "requests the target generates concurrently", type=_positive_int)
    d = p.add_argument_group("drafter")
    add(d, "--num-layers", "draft layers", type=_positive_int)
    add(d, "--intermediate-size", "MLP width of the draft layers; default: the target's", type=_positive_int)
    add(d, "--block-size", "B: the anchor token + B-1 mask slots", type=_at_least_two)
    add(d, "--num-taps", "target layers tapped, spread from layer 1 to L-3", type=_positive_int)
    add(d, "--target-layer-ids", "explicit tapped layers (overrides --num-taps)", nargs="+", type=_nonneg_int)
    add(d, "--mask-token-id", "mask id; default: the tokenizer's mask, else an id plain text never produces",
        type=_nonneg_int)
    add(d, "--init-from", "start from this DFlash checkpoint's weights ('shipped': the embedded model's drafter) with "
                          "a fresh optimizer and schedule, instead of random weights; a smaller drafter (fewer layers, "
                          "a narrower MLP, a subset of the taps) is grown into this run's shape, drafting as before")
    o = p.add_argument_group("optimisation")
    add(o, "--epochs", "passes over the sequences", type=_positive_int)
    add(o, "--batch-size", "sequences per optimizer step", type=_positive_int)
    add(o, "--anchors-per-seq", "random blocks per sequence", type=_positive_int)
    add(o, "--gamma", "slot k's loss weight is exp(-(k-1)/gamma); default 7 * B / 16", type=float)
    add(o, "--distill", "weight in [0, 1] of the cross-entropy against the target's whole distribution at "
                        "each slot (soft labels, for draft trees' top-k); the rest: against its tokens", type=float)
    add(o, "--rank-loss", "weight of a ranking term per slot (weighted by depth as the cross-entropy): softplus of "
                          "the drafter's --rank-topk-th best other logit over the target token's, which pushes the "
                          "token into the top-k a draft tree keeps; 0: off", type=float)
    add(o, "--rank-topk", "the top-k the ranking term aims at (the served trees' per-node top-k)", type=_positive_int)
    add(o, "--lr", "AdamW peak learning rate (cosine schedule)", type=float)
    add(o, "--warmup-ratio", "share of steps warming the learning rate up", type=float)
    add(o, "--max-grad-norm", "gradient clipping", type=float)
    add(o, "--seed", "model init, batch order, anchors", type=int)
    add(o, "--patience", "stop once this many validations in a row fail to beat the best top-k tree tau, and "
                         "export the best validation's drafter (needs --validation-prompts); default: run every "
                         "epoch and export the last", type=_positive_int)
    add(o, "--validate-every", "steps between validations (and one at the end; with --init-from also one before "
                               "the first step, the mark to beat); default: each epoch's end", type=_positive_int)
    add(o, "--cache-features", "compute the target's tap features once and keep them in host memory (small runs, "
                               "CPU); default: recompute them per batch (one target forward, nothing stored)",
        action="store_true")
    r = p.add_argument_group("run")
    add(r, "--save-every", "steps between trainer_state.pt saves", type=_positive_int)
    add(r, "--stop-after", "leave after this many steps (continue later with --resume)", type=_positive_int)
    add(r, "--resume", "continue the run in --out from trainer_state.pt", action="store_true")
    add(r, "--device", "auto: cuda if available", choices=["auto", "cpu", "cuda"])
    add(r, "--dtype", "the target's dtype (auto: bf16 on CUDA, fp32 on CPU); the drafter trains in fp32 "
                      "master weights under autocast", choices=["auto", "float32", "bfloat16"])


def _serving_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving mode (--serving, like sglang.bench_serving: ShareGPT prompts against a "
                             "running server)")
    g.add_argument("--serving", action="store_true", help="benchmark a running server instead of the offline engine")
    g.add_argument("--backend", default="sglang", choices=["sglang", "sglang-oai-chat"],
                   help="sglang: /generate; sglang-oai-chat: /v1/chat/completions")
    g.add_argument("--base-url", default="http://127.0.0.1:30000")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    g.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight at most")
    g.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: every request generates --max-new-tokens)")
    g.add_argument("--seed", type=int, default=0, help="ShareGPT sample and arrival times")
    g.add_argument("--client-processes", type=_positive_int, default=None,
                   help="processes sending the load (default: one per 8 requests in flight, within the cores); one "
                        "process parses only a few thousand streamed chunks a second")
    w = p.add_argument_group("serving sweep (--serving --sweep: servers started here, one per setting, in turn)")
    w.add_argument("--sweep", action="store_true",
                   help="start a server per --setting and load each at every --concurrency (not --base-url's)")
    w.add_argument("--concurrency", type=_positive_int, nargs="+", default=None, metavar="C",
                   help="the sweep's concurrencies (default 1 4 8 16 32 64); each run sends max(--num-prompts, 2C)")
    w.add_argument("--setting", action="append", default=None, metavar="NAME=FLAGS",
                   help="a server setting: serve flags added to --serve-flags (repeatable; default: "
                        "ar='--speculative-algorithm none', stock='--mechanisms stock', all='')")
    w.add_argument("--serve-flags", default="", metavar="FLAGS",
                   help="serve flags every setting shares, e.g. '--device cuda --model-path DIR'")
    w.add_argument("--warmup-prompts", type=_nonneg_int, default=8,
                   help="prompts each server gets before it is measured (default 8)")


def _dataset_args(p: argparse.ArgumentParser, default_prompts: int | None, default_tokens: int | None,
                  many: bool = False, help_prompts: str | None = None, help_tokens: str | None = None) -> None:
    from specpilot.bench.datasets import BENCH_DATASETS

    g = p.add_argument_group("workload")
    if many:
        g.add_argument("--dataset", nargs="+", default=["humaneval"], choices=BENCH_DATASETS, help="one or more")
    else:
        g.add_argument("--dataset", default="humaneval", choices=BENCH_DATASETS)
    g.add_argument("--num-prompts", type=_positive_int, default=default_prompts, help=help_prompts)
    g.add_argument("--max-new-tokens", type=_positive_int, default=default_tokens, help=help_tokens)


def _cmd_force(args: argparse.Namespace) -> int:
    if args.reference_url or args.candidate_url:
        return _force_servers(args)
    from dataclasses import replace

    from specpilot.bench.datasets import apply_chat_template, load_prompts
    from specpilot.engine.engine import Engine
    from specpilot.engine.registry import ar_changes
    from specpilot.forcing import run_forcing
    from specpilot.progress import progress_bars

    config = engine_config_from_args(args)
    candidate = Engine.from_config(config)
    if "b12" in candidate.mechanisms:  # the reference multiplies by the bf16 weights, not the candidate's B12
        stock = Engine.from_config(replace(config, **ar_changes(config)))
    else:  # the same weights and KV cache, taking turns
        stock = candidate.twin(**ar_changes(candidate.config))
    prompts = [apply_chat_template(candidate.tokenizer, p) for p in load_prompts(args.dataset, args.num_prompts)]
    params = sampling_params_from_args(args)
    with progress_bars() as progress:
        verdict = run_forcing(stock, candidate, prompts, params, config.speculative_algorithm or "none",
                              progress=progress)
    print(json.dumps(verdict.as_dict(), indent=2))
    return 0 if verdict.passed else 1


def _force_servers(args: argparse.Namespace) -> int:
    """`force` between two running servers (forcing/served.py): greedy, or seeded sampling at --temperature."""
    import httpx

    from specpilot.bench.datasets import apply_chat_template, load_prompts
    from specpilot.forcing.served import force_served, sglang_generate
    from specpilot.models.checkpoint import load_tokenizer

    if not (args.reference_url and args.candidate_url):
        raise SystemExit("specpilot force: --reference-url and --candidate-url go together")
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.model_path)
    except ValueError as err:
        raise SystemExit(f"specpilot force: --tokenizer: {err}") from None
    prompts = [apply_chat_template(tokenizer, p) for p in load_prompts(args.dataset, args.num_prompts)]
    sampling = None if args.temperature <= 0 else {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
        "sampling_seed": 0 if args.seed is None else args.seed}
    with (httpx.Client(base_url=args.reference_url, timeout=600, trust_env=False) as reference,
          httpx.Client(base_url=args.candidate_url, timeout=600, trust_env=False) as candidate):
        verdict = force_served(sglang_generate(reference, with_margins=True, sampling=sampling),
                               sglang_generate(candidate, with_margins=False, sampling=sampling), prompts,
                               args.max_new_tokens, args.tie_band)
    print(json.dumps(verdict.as_dict(), indent=2))
    return 0 if verdict.passed else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.profile_cost_table:
        return _profile_cost_table(args)
    if args.tune_gemm_tiles:
        return _tune_gemm_tiles(args)
    if args.sweep and not args.serving:
        raise ValueError("--sweep loads servers: pass it with --serving")
    if args.sweep:
        from specpilot.optimizer.serving_sweep import run_from_args as run_sweep

        return run_sweep(args)
    if args.serving:
        from specpilot.bench.serving import run_from_args

        return run_from_args(args)
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from specpilot.bench import provenance
    from specpilot.bench.charts import speedup_chart
    from specpilot.bench.harness import bench_dataset
    from specpilot.bench.output import bench_output_dir
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine
    from specpilot.engine.registry import in_effect

    config = engine_config_from_args(args, max_running_requests=args.batch_size)
    engine = Engine.from_config(config)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed)
    with Progress() as progress:
        results = [bench_dataset(engine, d, args.num_prompts, params, args.batch_size, args.repeats,
                                 progress, args.batching).as_dict() for d in args.dataset]
    out = bench_output_dir(args.output_dir)
    name = f"bench_{config.speculative_algorithm or 'ar'}_{engine.device.type}"
    prov = provenance.collect(engine.device, str(engine.dtype))
    report = {"provenance": prov, "config": vars(engine.config),
              "speed": in_effect(engine.config, engine.mechanisms), "device": engine.device.type,
              "dtype": str(engine.dtype), "batch_size": args.batch_size, "batching": args.batching,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "results": results}
    # default: the config's mechanisms, a frozenset, as a sorted list
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=sorted))
    title = f"specpilot bench ({config.speculative_algorithm or 'AR only'}, {engine.device.type})"
    table = Table(title=f"{title}: median (min–max) of {args.repeats} interleaved repeats",
                  caption=provenance.label(prov))
    batched = args.batch_size > 1  # then throughput's speedup, and the occupancy that explains how it differs
    columns = ["dataset", "prompts", "tau", "TPOT AR ms", "TPOT spec ms", "speedup"]
    columns += ["throughput ×", "decoding share AR / spec"] if batched else []
    for col in (*columns, "ids = AR"):
        table.add_column(col, overflow="fold")  # a narrow terminal wraps a range rather than cutting it
    for r in results:
        spread = r["spread"]
        keys = [("tau", ""), ("ar_tpot_ms", ""), ("spec_tpot_ms", ""), ("speedup", "×")]
        cells = [_median_range(spread[key], suffix) if key in spread else "n/a"
                 for key, suffix in keys + ([("throughput_speedup", "×")] if batched else [])]
        if batched:
            cells.append(f"{r['ar']['occupancy']:.0%} / {r['spec']['occupancy']:.0%}" if r["spec"] else "n/a")
        same = r["identical_ids"]["spec_repeats"] or r["identical_ids"]["ar_repeats"]
        cells.append(f"{min(same)}/{r['num_prompts']}" if same else "n/a")
        table.add_row(r["dataset"], str(r["num_prompts"]), *cells)
    Console().print(table)
    if engine.drafter is not None:
        speedup_chart(results, title, out / f"{name}.png", provenance.label(prov))
    print(f"results in {out}/: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _median_range(stat: dict, suffix: str) -> str:
    """The median, then the range over repeats in brackets."""
    return f"{stat['median']:.2f}{suffix} ({stat['min']:.2f}–{stat['max']:.2f})"


def sampling_params_from_args(args: argparse.Namespace):
    from specpilot.config import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, json_schema=args.json_schema,
        regex=args.regex, ebnf=args.ebnf, return_logprob=getattr(args, "logprobs", None) is not None,
        top_logprobs_num=getattr(args, "logprobs", None) or 0,
    )


def _algorithm(args: argparse.Namespace) -> str | None:
    return None if args.speculative_algorithm in (None, "none") else args.speculative_algorithm


def _profile_cost_table(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specpilot.bench import provenance
    from specpilot.bench.output import bench_output_dir
    from specpilot.costmodel.cost_table import cost_chart, profile_cost_table
    from specpilot.engine.cost_table import save_cost_table
    from specpilot.engine.engine import Engine

    engine = Engine.from_config(engine_config_from_args(args, max_running_requests=max(args.cost_batch_sizes)))
    table = profile_cost_table(engine, args.cost_batch_sizes, args.cost_tokens, args.cost_context, args.repeats)
    cached = save_cost_table(table)
    out = bench_output_dir(args.output_dir)
    prov = provenance.collect(engine.device, str(engine.dtype))
    (out / "cost_table.json").write_text(json.dumps({"provenance": prov, "table": json.loads(table.to_json())},
                                                   indent=2))
    cost_chart(table, out / "cost_table.png", provenance.label(prov))
    kinds = "chain / tree" if table.tree_ms is not None else "chain"
    view = Table(title=f"ms per pass ({kinds}): {table.key} (context {table.context}, "
                       f"{'graphs' if table.graphs else 'eager'})")
    view.add_column("B \\ rows", justify="right")
    for t in table.tokens:
        view.add_column(str(t), justify="right")
    for b, row, tree in zip(table.batch_sizes, table.ms, table.tree_ms or [None] * len(table.ms)):
        view.add_row(str(b), *(f"{ms:.3f}" if tree is None else f"{ms:.3f} / {t:.3f}" for ms, t in zip(row, tree or row)))
    Console().print(view)
    print(f"cached in {cached}; results in {out}/: cost_table.json, cost_table.png")
    return 0


def _tune_gemm_tiles(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch
    from rich.console import Console
    from rich.table import Table

    from specpilot.bench import provenance
    from specpilot.bench.output import bench_output_dir
    from specpilot.engine.engine import Engine
    from specpilot.engine.gemm_tiles import load_tile_table, save_tile_table, tune
    from specpilot.kernels.gemm_tiles import DECODE_BUCKETS, VERIFY_BUCKETS
    from specpilot.models.linear import iter_linears
    from specpilot.progress import bar

    config = replace(engine_config_from_args(args), tuned_tiles=False)
    if config.device == "cpu" or not torch.cuda.is_available():
        raise ValueError("--tune-gemm-tiles times the kernels on a CUDA device: pass --device cuda on a machine with one")
    engine = Engine.from_config(config)
    shapes = sorted({(linear.out_features, linear.in_features) for _, linear in iter_linears(engine.model)})
    buckets = {"decode": DECODE_BUCKETS, "verify": VERIFY_BUCKETS}
    table = tune(shapes, args.tile_kernels, [m for rows in args.tile_rows for m in buckets[rows]],
                 progress=lambda items: bar(items, "weight shapes"))
    cached = save_tile_table(table, load_tile_table(engine.device)[0])
    out = bench_output_dir(args.output_dir)
    prov = provenance.collect(engine.device, str(engine.dtype))
    (out / "gemm_tiles.json").write_text(json.dumps({"provenance": prov, "shapes": shapes,
                                                    "table": json.loads(table.to_json())}, indent=2))
    view = Table(title=f"tuned GEMM tiles: {table.device} ({len(shapes)} weight shapes; where none is listed the "
                       "untuned tiles were fastest)")
    for column in ("kernel", "N x K", "rows", "w tile (rows x K, warps, stages)", "x rows", "µs", "untuned µs"):
        view.add_column(column, justify="right")
    for (kernel, n, k, m), (tiles, block_m) in sorted(table.entries.items()):
        times = table.timings[(kernel, n, k, m)]
        view.add_row(kernel, f"{n} x {k}", f"<= {m}",
                     f"{tiles.block_n} x {tiles.block_k}, {tiles.num_warps}, {tiles.num_stages}",
                     str(block_m or "by M"), f"{times['us']:.1f}", f"{times['untuned_us']:.1f}")
    Console().print(view)
    print(f"cached in {cached}; results in {out}/gemm_tiles.json")
    return 0


def engine_config_from_args(args: argparse.Namespace, max_running_requests: int | None = None,
                            speculate: bool = False, shipped: bool = True) -> EngineConfig:
    """`max_running_requests`: the command's own default, where --max-running-requests is not given. The
    tunables: a flag given, else the --profile's value, else the registry's default for the device. On the
    embedded model, `speculate` makes DFlash (its shipped drafter) the default algorithm, and with `shipped`
    DFlash there takes the package's profile for the device unless --profile names another."""
    from dataclasses import replace

    from specpilot.engine.config import EngineConfig, resolve_device
    from specpilot.engine.registry import (
        TUNABLES,
        Profile,
        embedded_profile,
        open_defaults,
        parse_mechanisms,
    )

    device = resolve_device(args.device).type
    embedded = args.model_path is None and args.speculative_draft_model_path is None
    algorithm = "dflash" if speculate and embedded and args.speculative_algorithm is None else _algorithm(args)
    profile = args.profile
    if profile is None and shipped and embedded and algorithm == "dflash":
        profile = embedded_profile(device)
        if profile is not None:
            logging.getLogger("specpilot").info("speed settings: the shipped profile %s", profile)
    config = EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype,
                          context_length=args.context_length, max_total_tokens=args.max_total_tokens,
                          page_size=args.page_size, mem_fraction_static=args.mem_fraction_static,
                          max_running_requests=max_running_requests, speculative_algorithm=algorithm,
                          speculative_draft_model_path=args.speculative_draft_model_path,
                          batch_invariant=args.batch_invariant, tuned_tiles=args.tuned_tiles,
                          **open_defaults(device, algorithm))
    if profile is not None:
        config = Profile.load(profile).apply(config)
    given = {t.field: getattr(args, t.field) for t in TUNABLES if getattr(args, t.field) is not None}
    if "cuda_graph_batch_sizes" in given:
        given["cuda_graph_batch_sizes"] = tuple(given["cuda_graph_batch_sizes"])
    if args.mechanisms is not None:
        given["mechanisms"] = parse_mechanisms(args.mechanisms)
    return replace(config, **given)


def _cmd_serve(args: argparse.Namespace) -> int:
    from specpilot.engine.config import EngineConfig
    from specpilot.server.context import ServerArgs
    from specpilot.server.launch import serve

    if args.engine_config is not None:
        try:
            config = EngineConfig.from_fields(json.loads(pathlib.Path(args.engine_config).read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise SystemExit(f"specpilot serve: --engine-config {args.engine_config}: {err}") from err
    else:
        config = engine_config_from_args(args, speculate=True)
    return serve(config,
                 ServerArgs(host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
                            served_model_name=args.served_model_name,
                            shutdown_grace_period=args.shutdown_grace_period,
                            engine_process=not args.single_process, stream_interval=args.stream_interval))


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from specpilot.training.train import TrainConfig, train_drafter, validation_taus

    names = {f.name for f in fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    config.target = None if args.target == "default" else args.target
    report = train_drafter(config)
    last = report["epochs"][-1] if report["epochs"] else {}
    state = "done" if report["finished"] else f"stopped at step {report['steps']}/{report['total_steps']}"
    if report["stopped_early"]:
        best = report["validation"][report["exported_epoch"] - 1]
        state = (f"stopped early at step {report['steps']} of {report['total_steps']}, exported the drafter of "
                 f"validation {report['exported_epoch']} (step {best.get('step', '?')})")
    tau = f", validation {validation_taus(report['validation'][-1])}" if report["validation"] else ""
    if report.get("start_validation"):
        tau += f" (at the start: {validation_taus(report['start_validation'])})"
    print(f"{state}: loss {last.get('loss', float('nan')):.4f}{tau}; wrote {config.out}")
    return 0


def _cmd_costmodel(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specpilot.bench import provenance
    from specpilot.bench.datasets import apply_chat_template, load_prompts
    from specpilot.costmodel import calibrate, floors, rank_gaps, shapes_of
    from specpilot.costmodel.measure import measure, replays_graphs
    from specpilot.costmodel.report import ceilings_table, chart, gaps_table, steps_table
    from specpilot.engine.engine import Engine

    engine = Engine.from_config(engine_config_from_args(args, max_running_requests=args.batch_size))
    console = Console()
    ceilings = calibrate(engine.device, engine.dtype)
    console.print(ceilings_table(ceilings))
    measured, context = None, args.context or 512
    if args.measure:
        prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(args.dataset, args.num_prompts)]
        measured, mean_context = measure(engine, prompts[: args.batch_size] or prompts, args.max_new_tokens)
        context = args.context or mean_context
    shapes = shapes_of(engine)
    floor = floors(shapes, ceilings, args.batch_size, context, replays_graphs(engine))
    console.print(steps_table(floor, measured))
    gaps = rank_gaps(measured, floor) if measured else []
    if gaps:
        console.print(gaps_table(gaps))
    out = pathlib.Path(args.output_dir or "specpilot-costmodel")
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance.collect(engine.device, str(engine.dtype))
    report = {"provenance": prov, "config": vars(engine.config), "shapes": vars(shapes),
              "ceilings": ceilings.as_dict(), "floors": floor.as_dict(),
              "measured": None if measured is None else vars(measured) | {"speedup": measured.speedup},
              "gaps": [g.as_dict() for g in gaps]}
    (out / "costmodel.json").write_text(json.dumps(report, indent=2, default=sorted))
    if measured is not None:
        chart(floor, measured, gaps, out / "costmodel.png", provenance.label(prov))
    print(f"results in {out}/: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _cmd_optimize(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specpilot.engine.config import resolve_device
    from specpilot.engine.registry import TUNABLES
    from specpilot.memory import DEFAULT_PATH
    from specpilot.optimizer.llm_agent import Endpoint
    from specpilot.optimizer.loop import Settings, optimize, plain_stock

    endpoint = Endpoint.resolve(args.llm_base_url, args.llm_model)  # the key only from $SPECPILOT_LLM_API_KEY

    if args.rounds == 0 and not (args.resume and args.baseline):
        raise ValueError("--rounds 0 judges nothing: it needs --resume --baseline (the baseline for the rounds "
                         "already in memory)")
    if args.repeats < min_pairs():
        raise ValueError(f"--repeats: {args.repeats} pairs can never show a speedup at p <= 0.05; give at least "
                         f"{min_pairs()}")
    # the search starts from stock, with the device's defaults as a prior, not from a shipped profile
    config = engine_config_from_args(args, max_running_requests=1, shipped=False)
    if not config.speculative_algorithm:
        raise ValueError("--speculative-algorithm: optimize tunes a speculative deployment; name its drafter")
    config, prior = plain_stock(config, {t.field for t in TUNABLES if getattr(args, t.field, None) is not None})
    prompts, tokens = OPTIMIZE_WORKLOAD[resolve_device(config.device).type]
    settings = Settings(config, rounds=args.rounds, agents=args.agents, per_agent=args.proposals_per_agent,
                        dataset=args.dataset, num_prompts=args.num_prompts or prompts,
                        max_new_tokens=args.max_new_tokens or tokens,
                        repeats=args.repeats, db=args.db or DEFAULT_PATH, out=args.output_dir or "specpilot-optimize",
                        resume=args.resume, priors=[prior] if prior else [], baseline=args.baseline,
                        llm=asdict(endpoint) if endpoint else None, llm_attempts=args.llm_attempts,
                        llm_source_chars=args.llm_source_chars)
    result = optimize(settings)
    keys = ("profile", "profile_path", "patch_path", "speedup_over_stock", "evaluations", "baseline", "paused")
    print(json.dumps({k: result[k] for k in keys if k in result}, indent=2))
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specpilot.memory import DEFAULT_PATH, Memory

    path = pathlib.Path(args.db or DEFAULT_PATH)
    wanted = {"list": 0, "show": 1, "export": 0, "diff": 2}[args.action]
    if len(args.rounds) != wanted:
        raise ValueError(f"memory {args.action} takes {wanted} ROUND id(s), got {len(args.rounds)}")
    if not path.is_file():
        raise FileNotFoundError(f"--db: no memory file at {path}")
    memory = Memory(path)
    if args.action == "export":
        print(json.dumps(memory.export(), indent=2))
    elif args.action == "show":
        print(json.dumps(memory.round_report(args.rounds[0]), indent=2))
    elif args.action == "diff":
        print(json.dumps(memory.diff(*args.rounds), indent=2))
    else:
        table = Table(title=f"{path}: rounds")
        for col in ("round", "no.", "status", "deployment", "candidates", "accepted"):
            table.add_column(col, overflow="fold")
        for row in memory.rounds():
            deployment = f"{row['target']} + {row['drafter'] or 'AR'}, {row['device']}, {row['dtype']}, {row['load']}"
            table.add_row(str(row["id"]), str(row["number"]), row["status"], deployment, str(row["candidates"]),
                          str(row["accepted"]))
        Console().print(table)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from specpilot.models.convert import convert_to_b12

    report = convert_to_b12(args.model_path, args.out)
    print(f"{len(report['tensors'])} matrices as B12: {report['bits_per_weight']:.3f} bits a weight, escape rate "
          f"{report['escape_rate']:.2e}; kept bf16: {len(report['kept_bf16'])}; written to {args.out}")
    return 0


def _cmd_registry(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specpilot.engine.config import resolve_device
    from specpilot.engine.registry import catalog

    algorithm = _algorithm(args)
    device = resolve_device(args.device).type
    entries = catalog(device, algorithm)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    console = Console()
    for kind, columns in (("tunables", ("name", "flag", "domain", "default", "stages")),
                          ("mechanisms", ("name", "stages", "needs", "summary"))):
        title = f"{kind} (defaults: {device}, {algorithm or 'no drafter'})" if kind == "tunables" else kind
        table = Table(title=title)
        for col in columns:
            table.add_column(col, overflow="fold")
        for entry in entries[kind]:
            if entry.get("on_by_default") is False:
                entry = entry | {"summary": f"(off unless asked for) {entry['summary']}"}
            table.add_row(*(_cell(entry[col]) for col in columns))
        console.print(table)
    return 0


def _cell(value: object) -> str:
    """Names (stages, needs) as a list to read; values as JSON, as a profile spells them."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ", ".join(value)
    return value if isinstance(value, str) else json.dumps(value)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specpilot.engine.engine import Engine
    from specpilot.models.prompts import encode_prompt

    params = sampling_params_from_args(args)
    engine = Engine.from_config(engine_config_from_args(args, max_running_requests=1, speculate=True))
    if engine.tokenizer is None:
        raise ValueError(f"--model-path {args.model_path}: the checkpoint has no tokenizer files")
    ids = encode_prompt(engine.tokenizer, args.prompt, args.chat)
    [req] = engine.generate([ids], params)
    text = engine.output_text(req)
    if args.json:
        out = {"text": text, "output_ids": req.output_ids, "meta_info": req.meta_info()}
        if params.return_logprob:
            out["logprobs"] = [{"logprob": e.logprob, "top": e.top} for e in req.logprobs]
        print(json.dumps(out))
    else:
        print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tui"]:  # the app starts without building the other commands' parsers (they import torch)
        return tui_launch.main(argv[1:], prog="specpilot tui")
    parser = build_parser()
    args = parser.parse_args(argv)
    # one-shot generation prints only its text; the long-running commands say what they are doing
    level = args.log_level or ("WARNING" if args.command in ("generate", "tui") else "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))  # a line per request
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    sys.exit(main())
