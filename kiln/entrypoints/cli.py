"""The `kiln` command line: generate | chat | serve | bench | warmup | cache."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from kiln.config import EngineConfig
from kiln.entrypoints.cache_cli import cmd_cache, cmd_warmup
from kiln.lora import LoRARequest


def _default(name: str) -> Any:
    return EngineConfig.__dataclass_fields__[name].default


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("-O", "--optimization-level", dest="optimization_level", type=int,
                   default=2, choices=range(4), metavar="N",
                   help="optimization level -O0..-O3 (default -O2): -O0 eager, -O1 compiled "
                        "pieces + piecewise CUDA graphs, -O2 + full CUDA graphs for decode, "
                        "-O3 + max-autotune on CUDA, cpp_wrapper on the CPU; fields set "
                        "explicitly win")
    p.add_argument("-cc", "--compilation-config", default=None, metavar="JSON",
                   help="compilation fields as JSON, e.g. '{\"cudagraph_mode\": \"piecewise\", "
                        "\"cudagraph_capture_sizes\": [1, 2, 4]}'; they win over -O")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_default("max_num_batched_tokens"))
    p.add_argument("--block-size", type=int, default=_default("block_size"))
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--attention-backend", default=None,
                   help="torch | triton (default: triton on CUDA, torch on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None,
                   help="compile cache location (default: $KILN_CACHE_DIR or "
                        "$KILN_HOME/compile_cache)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile without reading or writing the compile cache")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV of shared prompt prefixes")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on prefill tokens per request per step (0: off)")
    p.add_argument("-q", "--quantization", default=None,
                   choices=["int8", "int8-channel", "fp8", "gguf", "none"],
                   help="weight quantization: int8 (weight-only, per output channel, a scale "
                        "per 32 inputs; made at load from a float checkpoint), int8-channel "
                        "(one scale per output channel), fp8 (e4m3, CUDA), gguf (a .gguf file's blocks, "
                        "native), none (dequantize a .gguf file at load); unset: as the "
                        "checkpoint is")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N ranks (processes) with torch.distributed")
    p.add_argument("--distributed-executor-backend", default=None,
                   choices=["uni", "mp", "external_launcher"],
                   help="who runs the ranks: uni (in process, tp=1), mp (one process per "
                        "rank; the default for tp>1), external_launcher (torchrun)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (slots on every decoder linear)")
    p.add_argument("--max-loras", type=int, default=_default("max_loras"), metavar="N",
                   help="distinct adapters one step may run (device slots; default 1)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="M",
                   help="adapters kept loaded behind the slots, LRU (default: --max-loras)")
    p.add_argument("--max-lora-rank", type=int, default=_default("max_lora_rank"),
                   metavar="R", help="largest adapter rank accepted (default 16)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's names: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (also prompt_lookup_min/max), or "
                        "'{\"method\": \"draft_model\", \"model\": PATH, "
                        "\"num_speculative_tokens\": 4}'")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="KV connector, vLLM's names: '{\"kv_connector\": \"disk\", "
                        "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": "
                        "{\"path\": DIR, \"max_size\": \"4GiB\"}}' (a KV tier that "
                        "survives restarts), or kv_connector torch_distributed with kv_role "
                        "kv_producer / kv_consumer for prefill/decode disaggregation")


def _lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-path", default=None, metavar="DIR",
                   help="run the prompts with this PEFT LoRA adapter (turns LoRA on)")
    p.add_argument("--lora-name", default=None,
                   help="the adapter's name (default: the directory's name)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text appears (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    g = p.add_argument_group("structured output (one of)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output is JSON valid against this JSON schema file")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is exactly one of these (repeatable)")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="the output follows this EBNF grammar file")


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
        _lora_args(p)
    serve = sub.add_parser("serve", help="serve the OpenAI API (completions, chat) over HTTP")
    warm = sub.add_parser("warmup", help="compile (or load) everything for a configuration "
                                         "into the compile cache and report")
    for p in (gen, chat, warm):
        _engine_args(p)
        _sampling_args(p)
        p.add_argument("-v", "--verbose", action="store_true")
    from kiln.entrypoints.openai.server import add_serve_args

    add_serve_args(serve)
    _engine_args(serve)
    serve.add_argument("-v", "--verbose", action="store_true")
    cache = sub.add_parser("cache", help="inspect the compile cache")
    cache.add_argument("action", choices=["ls", "verify", "clear"])
    cache.add_argument("--cache-dir", default=None)
    cache.add_argument("-v", "--verbose", action="store_true")
    from kiln.bench.cli import add_bench_parser

    add_bench_parser(sub, _engine_args)
    return parser


def _make_llm(args: argparse.Namespace) -> Any:
    from kiln.entrypoints.llm import LLM

    return LLM(args.model, dtype=args.dtype, optimization_level=args.optimization_level,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
               attention_backend=args.attention_backend, seed=args.seed,
               compilation=_compilation(args),
               enable_prefix_caching=not args.no_prefix_caching,
               scheduling_policy=args.scheduling_policy,
               long_prefill_token_threshold=args.long_prefill_token_threshold,
               tensor_parallel_size=args.tensor_parallel_size,
               distributed_executor_backend=args.distributed_executor_backend,
               quantization=args.quantization, enable_lora=args.enable_lora,
               max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
               max_lora_rank=args.max_lora_rank,
               speculative_config=args.speculative_config,
               kv_transfer_config=args.kv_transfer_config)


def _lora_request(args: argparse.Namespace) -> LoRARequest | None:
    """The adapter of --lora-path (id 1), or None; turns LoRA on when there is one."""
    if args.lora_path is None:
        if args.lora_name is not None:
            raise ValueError("--lora-name needs --lora-path DIR (the adapter directory)")
        return None
    args.enable_lora = True
    name = args.lora_name or Path(args.lora_path).resolve().name
    return LoRARequest(name, 1, args.lora_path)


def _checked_llm(args: argparse.Namespace, lora: LoRARequest | None) -> Any:
    """The LLM, with the adapter checked up front: a bad one is a clear error (exit 2),
    not an error line per prompt."""
    llm = _make_llm(args)
    if lora is not None:
        llm.engine.add_lora(lora)
    return llm


def _compilation(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"cache_dir": args.cache_dir,
                              "use_cache": not args.no_compile_cache,
                              "backend": args.compile_backend}
    if args.compilation_config:
        try:
            extra = json.loads(args.compilation_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--compilation-config is not valid JSON ({exc}); write e.g. "
                             "'{\"cudagraph_mode\": \"none\"}'") from None
        if not isinstance(extra, dict):
            raise ValueError("--compilation-config must be a JSON object of compilation "
                             "fields")
        fields.update(extra)
    return fields


def _params(args: argparse.Namespace) -> Any:
    from kiln.sampling import SamplingParams

    return SamplingParams(
        n=getattr(args, "n", 1), temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos, seed=args.seed, structured_outputs=_structured(args))


def _structured(args: argparse.Namespace) -> Any:
    """--json-schema / --json-object / --regex / --choice / --grammar, checked now."""
    from kiln.structured_output import StructuredOutputsParams
    from kiln.structured_output.backend import grammar_for

    fields = {"json": _read(args.json_schema, "--json-schema"),
              "json_object": args.json_object or None, "regex": args.regex,
              "choice": args.choice, "grammar": _read(args.grammar, "--grammar")}
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --json-object, --regex, --choice, "
                         "--grammar")
    params = StructuredOutputsParams(**given)
    grammar_for(params)  # a bad schema, regex or grammar fails before the model loads
    return params


def _read(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # bad sampling values fail before the model loads
    lora = _lora_request(args)
    llm = _checked_llm(args, lora)
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
    print(f"\nload {llm.engine.load_time_s:.1f} s | {tokens} tokens in {elapsed:.2f} s | "
          f"{tokens / elapsed:.1f} tok/s | {llm.engine.dtype} activations, quantization "
          f"{llm.engine.quantization.method or 'none'}")
    return 0


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
    lora = _lora_request(args)
    llm = _checked_llm(args, lora)
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
        out = llm.chat(history, _params(args), use_tqdm=False, lora_request=lora)[0]
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
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench":
            from kiln.bench.cli import cmd_bench

            return cmd_bench(args, _make_llm, _engine_args)
        if args.command == "warmup":
            return cmd_warmup(args, _make_llm)
        if args.command == "cache":
            return cmd_cache(args)
        if args.command == "serve":
            from kiln.entrypoints.openai.server import cmd_serve

            return cmd_serve(args, _make_llm)
        return {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
    except ValueError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
