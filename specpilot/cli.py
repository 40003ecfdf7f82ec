"""`specpilot` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

DEFAULT_PROMPT = "Write a haiku about the sea."


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model-path", default=None,
                   help="GGUF file or Hugging Face directory (config.json + safetensors); default: the embedded "
                        "SmolLM2-135M-Instruct")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--context-length", type=_positive_int, default=4096, help="KV positions per request")
    g.add_argument("--max-running-requests", type=_positive_int, default=32)
    g.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly on CUDA")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpilot", description="Lossless speculative decoding serving stack.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from the shell",
                         description="One-shot generation. Without --model-path the embedded default model is used.")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object {text, output_ids, meta_info}")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)
    return parser


def sampling_params_from_args(args: argparse.Namespace):
    from specpilot.config import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
    )


def engine_config_from_args(args: argparse.Namespace):
    from specpilot.engine.engine import EngineConfig

    return EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype,
                        context_length=args.context_length, max_running_requests=args.max_running_requests,
                        cuda_graphs=not args.disable_cuda_graph)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if tokenizer.chat_template is None:
            raise ValueError("--chat: this model's tokenizer has no chat template")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return tokenizer.encode(prompt)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specpilot.engine.engine import Engine

    params = sampling_params_from_args(args)
    engine = Engine.from_config(engine_config_from_args(args))
    if engine.tokenizer is None:
        raise ValueError(f"--model-path {args.model_path}: the checkpoint has no tokenizer files")
    ids = encode_prompt(engine.tokenizer, args.prompt, args.chat)
    [req] = engine.generate([ids], params)
    text = engine.output_text(req)
    if args.json:
        print(json.dumps({"text": text, "output_ids": req.output_ids, "meta_info": {
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
            "finish_reason": req.finish_reason, "e2e_latency": round(req.e2e_latency, 6)}}))
    else:
        print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    sys.exit(main())
