"""The `kiln` command line: generate | chat | serve | bench | warmup | cache."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, Sequence

from kiln.bench.cli import add_bench_parser, cmd_bench
from kiln.cli.cache import cmd_cache, cmd_warmup
from kiln.entrypoints.args import (add_engine_args, add_lora_args, add_sampling_args,
                                   lora_request, make_llm, sampling_params)
from kiln.entrypoints.openai.server import add_serve_args, cmd_serve
from kiln.lora.request import LoRARequest
from kiln.sampling.defaults import describe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the answers")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("-n", type=int, default=1, help="samples per prompt")
    chat = sub.add_parser("chat", help="multi-turn chat at a prompt")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        add_lora_args(p)
    serve = sub.add_parser("serve", help="serve the OpenAI API (completions, chat) over HTTP")
    warm = sub.add_parser("warmup", help="compile (or load) everything for a configuration "
                                         "into the compile cache and report")
    for p in (gen, chat, warm):
        add_engine_args(p)
        add_sampling_args(p)
        p.add_argument("-v", "--verbose", action="store_true")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.add_argument("-v", "--verbose", action="store_true")
    cache = sub.add_parser("cache", help="inspect the compile cache")
    cache.add_argument("action", choices=["ls", "verify", "clear"])
    cache.add_argument("--cache-dir", default=None)
    cache.add_argument("-v", "--verbose", action="store_true")
    add_bench_parser(sub)
    return parser


def _checked_llm(args: argparse.Namespace, lora: LoRARequest | None) -> Any:
    """The LLM, with the adapter checked up front: a bad one is a clear error (exit 2),
    not an error line per prompt."""
    llm = make_llm(args)
    if lora is not None:
        llm.engine.add_lora(lora)
    return llm


def _start(args: argparse.Namespace) -> tuple[Any, LoRARequest | None, Any]:
    """(LLM, adapter, sampling params) of generate and chat. Bad sampling values and a
    bad constraint fail before the model loads; the params then take the model's
    generation-config defaults for the flags not given."""
    checked = sampling_params(args)
    lora = lora_request(args)
    llm = _checked_llm(args, lora)
    params = sampling_params(args, llm.engine.default_sampling,
                             structured=checked.structured_outputs)
    return llm, lora, params


def cmd_generate(args: argparse.Namespace) -> int:
    llm, lora, params = _start(args)
    prompts: list[Any] = args.prompts
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    if args.stream:
        tokens = _stream(llm, args.prompts, prompts, params, lora)
    else:
        tokens = _print_all(args.prompts, llm.generate(prompts, params,
                                                       use_tqdm=len(prompts) > 1,
                                                       lora_request=lora))
    elapsed = time.perf_counter() - start
    print(f"\nstart-up: {llm.engine.phases.describe()}")
    print(f"load {llm.engine.load_time_s:.1f} s | {tokens} tokens in {elapsed:.2f} s | "
          f"{tokens / elapsed:.1f} tok/s | {llm.engine.dtype} activations, quantization "
          f"{llm.engine.quantization.method or 'none'}{_defaults_note(llm)}")
    return 0


def _defaults_note(llm: Any) -> str:
    """Names the generation-config defaults the run used (flags given still win)."""
    fields = llm.engine.default_sampling
    return f" | generation config: {describe(fields)}" if fields else ""


def _print_all(shown: list[str], outputs: list[Any]) -> int:
    tokens = 0
    for prompt, out in zip(shown, outputs):
        print(f"\n>>> {prompt}")
        if out.error:
            print(f"[error] {out.error}")
        for c in out.outputs:
            print((f"[{c.index}] " if len(out.outputs) > 1 else "") + c.text.strip())
            tokens += len(c.token_ids)
    return tokens


def _stream(llm: Any, shown: list[str], prompts: list[Any], params: Any,
            lora: LoRARequest | None) -> int:
    """Print each request's text as it arrives. Streams of several prompts or samples
    interleave, so each burst of text is labelled when its source changes."""
    tokens, current = 0, None
    labels = {str(i): p for i, p in enumerate(shown)}
    for out in llm.generate_stream(prompts, params, lora_request=lora):
        for c in out.outputs:
            key = (out.request_id, c.index)
            if key != current and (len(shown) > 1 or params.n > 1 or current is None):
                label = labels.get(out.request_id, out.request_id)
                suffix = f" [{c.index}]" if params.n > 1 else ""
                print(f"\n>>> {label}{suffix}", flush=True)
                current = key
            print(c.text, end="", flush=True)
            tokens += len(c.token_ids)
        if out.error:
            print(f"[error] {out.error}", flush=True)
    print()
    return tokens


def cmd_chat(args: argparse.Namespace) -> int:
    llm, lora, params = _start(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kiln chat: type a message; empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line or line in ("/exit", "/quit"):
            break
        history.append({"role": "user", "content": line})
        out = llm.chat(history, params, use_tqdm=False, lora_request=lora)[0]
        if out.error:
            print(f"[error] {out.error}")
            history.pop()
            continue
        answer = out.outputs[0].text.strip()
        print(f"kiln> {answer}")
        history.append({"role": "assistant", "content": answer})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve -dp N` reuses it
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "warmup":
            return cmd_warmup(args)
        if args.command == "cache":
            return cmd_cache(args)
        if args.command == "serve":
            return cmd_serve(args)
        return {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
    except ValueError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
