"""`kiln bench latency | throughput | serve | compile | kernels | quality | sampling |
lora | structured | spec | kv | pd | moe | hybrid-kv | budget`: arguments and dispatch.

Every mode prints a table, writes its result as JSON with `--json PATH` (schemas in each
mode's module docstring) and PNG charts into `--plot DIR` (kv, pd, moe, hybrid-kv and
sampling draw none).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kiln.entrypoints.args import add_engine_args, make_llm

def _outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    p.add_argument("-v", "--verbose", action="store_true")


def add_bench_parser(sub: Any) -> None:
    """Add `bench` and its modes to the `kiln` subcommand parser `sub`."""
    bench = sub.add_parser("bench", help="benchmarks and kernel tuning: latency | throughput "
                                         "| serve | compile | kernels | quality | sampling | lora "
                                         "| structured | spec | kv | pd | moe | hybrid-kv "
                                         "| budget")
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    lat = modes.add_parser("latency", help="one fixed batch, timed per engine step")
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    tp = modes.add_parser("throughput", help="N offline requests run to completion")
    tp.add_argument("--num-prompts", type=int, default=32)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="draw lengths uniformly in len*(1-r)..len*(1+r)")
    tp.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy; vLLM's benchmark uses 1.0)")
    srv = modes.add_parser("serve", help="load a running OpenAI-compatible server on this "
                                         "machine (kiln serve)")
    srv.add_argument("--url", default="http://127.0.0.1:8000",
                     help="server base URL; localhost / 127.0.0.1 / [::1] only")
    srv.add_argument("--served-model-name", default=None,
                     help="model name to send (default: the first of GET /v1/models)")
    srv.add_argument("--num-prompts", type=int, default=32)
    srv.add_argument("--input-len", type=int, default=128)
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--random-range-ratio", type=float, default=0.0)
    srv.add_argument("--request-rate", type=float, default=math.inf,
                     help="Poisson arrival rate in requests/s (default inf: all at once)")
    srv.add_argument("--max-concurrency", type=int, default=None)
    srv.add_argument("--prompt-type", default="text", choices=["text", "ids"],
                     help="text words, or token ids (models without a tokenizer)")
    srv.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    srv.add_argument("--seed", type=int, default=0)
    comp = modes.add_parser("compile", help="cold vs warm start-up per optimization level "
                                            "(fresh processes)")
    comp.add_argument("--levels", type=int, nargs="+", default=[0, 1])
    ker = modes.add_parser("kernels", help="time candidate kernels per shape and write the "
                                           "tuning table")
    ker.add_argument("--ops", nargs="+", default=None,
                     help="linear linear_quant fused_moe attention rms_norm rope "
                          "silu_and_mul top_k_top_p (default: all)")
    ker.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32],
                     help="decode batch sizes")
    ker.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512])
    ker.add_argument("--context-len", type=int, default=256,
                     help="KV tokens per decoding request")
    ker.add_argument("--no-compiled", action="store_true",
                     help="skip torch.compile candidates (they compile on first use)")
    ker.add_argument("--warmup", type=int, default=3)
    ker.add_argument("--iters", type=int, default=20)
    ker.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    ker.add_argument("--tuning-file", default=None,
                     help="tuning table to update (default: $KILN_TUNING_FILE or "
                          "$KILN_HOME/tuning.json)")
    ker.add_argument("--no-write", action="store_true", help="do not write the tuning table")
    for p in (lat, tp, comp, ker):
        add_engine_args(p)
    qual = modes.add_parser("quality", help="perplexity and greedy agreement per "
                                            "quantization method")
    add_engine_args(qual)
    methods = ["none", "int8", "int8-channel", "gguf"]
    qual.add_argument("--methods", nargs="+", default=methods, choices=methods)
    qual.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    qual.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    qual.add_argument("--max-windows", type=int, default=None,
                      help="score only the text's first N windows (default: all of it)")
    samp = modes.add_parser("sampling", help="loop rate, distinct-2 and length of chat "
                            "answers per candidate default sampling parameters")
    add_engine_args(samp)
    samp.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    samp.add_argument("--seeds", type=int, default=3, help="runs of each sampled candidate")
    lora = modes.add_parser("lora", help="N requests over several random adapters vs the "
                            "base model (with and without LoRA on), interleaved")
    _interleaved_workload(lora, input_len=True)
    lora.add_argument("--num-adapters", type=int, default=4)
    lora.add_argument("--rank", type=int, default=16)
    st = modes.add_parser("structured", help="per-step cost of JSON-schema constraints on "
                          "N requests vs none, interleaved")
    _interleaved_workload(st, input_len=False)
    sp = modes.add_parser("spec", help="speculative decoding vs none at batch 1 on an "
                          "input-grounded and a free-chat workload, interleaved")
    add_engine_args(sp)
    sp.add_argument("--output-len", type=int, default=192)
    sp.add_argument("--repeats", type=int, default=3)
    kv = modes.add_parser("kv", help="TTFT of a long shared prefix in a fresh process: "
                                     "warm disk KV tier vs none (and the cost of saving)")
    add_engine_args(kv)
    kv.add_argument("--prefix-len", type=int, default=1500)
    kv.add_argument("--repeats", type=int, default=3)
    pd = modes.add_parser("pd", help="prefill/decode disaggregation (two servers and the "
                                     "proxy) vs one server, under concurrent streams")
    add_engine_args(pd)
    pd.add_argument("--num-prompts", type=int, default=32)
    pd.add_argument("--input-len", type=int, default=1000)
    pd.add_argument("--output-len", type=int, default=64)
    pd.add_argument("--max-concurrency", type=int, default=16)
    pd.add_argument("--shared-cpus", action="store_true",
                    help="run P and D on every CPU (default: half each)")
    soak = modes.add_parser("soak", help="a long mixed load (chat, streams, n=2, JSON "
                            "schema, tools, an adapter, dropped streams, hostile requests) "
                            "on a real kiln serve with LoRA, n-gram and the disk KV tier")
    soak.add_argument("--model", default=None, help="default: the embedded model")
    soak.add_argument("--duration-s", type=float, default=1800.0)
    soak.add_argument("--clients", type=int, default=6)
    for feature in ("lora", "ngram", "kv-tier"):
        soak.add_argument(f"--no-{feature}", action="store_true",
                          help=f"serve without {feature.replace('-', ' ')}")
    soak.add_argument("--serve-args", default="", help="more `kiln serve` flags, quoted")
    _outputs(soak)
    moe = modes.add_parser("moe", help="decode throughput of a small random Mixtral (8 "
                                       "experts, top-2): kiln vs transformers")
    moe.add_argument("-O", dest="optimization_level", type=int, default=2,
                     choices=[0, 1, 2, 3])
    moe.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    moe.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    moe.add_argument("--input-len", type=int, default=32)
    moe.add_argument("--output-len", type=int, default=64)
    moe.add_argument("--repeats", type=int, default=3)
    hyb = modes.add_parser("hybrid-kv", help="KV blocks a 5:1 local:global model holds at "
                           "long context vs full attention (random Gemma 3)")
    hyb.add_argument("--context", type=int, default=4096)
    hyb.add_argument("--window", type=int, default=512)
    hyb.add_argument("--pattern", type=int, default=6, help="one global layer in PATTERN")
    hyb.add_argument("--num-layers", type=int, default=6)
    hyb.add_argument("--output-len", type=int, default=8)
    hyb.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    bud = modes.add_parser("budget", help="the chunked-prefill token budget for this model "
                           "and host: prefill rate vs step length per candidate, written to "
                           "the tuning table")
    add_engine_args(bud)
    bud.add_argument("--candidates", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    bud.add_argument("--prompt-len", type=int, default=4096)
    bud.add_argument("--decode-rows", type=int, default=8)
    bud.add_argument("--threshold", type=float, default=0.9,
                     help="the smallest budget within this share of the best prefill rate")
    bud.add_argument("--repeats", type=int, default=2)
    bud.add_argument("--no-write", dest="write", action="store_false",
                     help="print the choice without writing the tuning table")
    for p in (lat, tp, srv, comp, ker, qual, samp, lora, st, sp, kv, pd, moe, hyb, bud):
        _outputs(p)


def _interleaved_workload(p: argparse.ArgumentParser,
                          input_len: bool) -> None:
    """The offline workload of the modes that interleave cases `--repeats` times."""
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    if input_len:
        p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)


def cmd_bench(args: argparse.Namespace) -> int:
    mode = args.bench_mode
    result: dict[str, Any]
    if mode == "latency":
        from kiln.bench.latency import format_latency as fmt, plot_latency as plot, run_latency

        if args.batch_size > args.max_num_seqs:
            raise ValueError(f"batch_size={args.batch_size} exceeds --max-num-seqs="
                             f"{args.max_num_seqs}: a fixed batch must run at once; raise "
                             "--max-num-seqs")
        result = run_latency(make_llm(args), args.batch_size, args.input_len,
                             args.output_len, args.num_iters, args.num_iters_warmup, args.seed)
    elif mode == "throughput":
        from kiln.bench.throughput import (format_throughput as fmt, plot_throughput as plot,
                                           run_throughput)

        result = run_throughput(make_llm(args), args.num_prompts, args.input_len,
                                args.output_len, args.random_range_ratio, args.seed,
                                temperature=args.temperature)
    elif mode == "serve":
        from kiln.bench.serve import format_serve as fmt, plot_serve as plot, run_serve

        rate = None if math.isinf(args.request_rate) else args.request_rate
        result = run_serve(args.url, args.num_prompts, args.input_len, args.output_len,
                           model=args.served_model_name, request_rate=rate,
                           max_concurrency=args.max_concurrency,
                           random_range_ratio=args.random_range_ratio,
                           prompt_type=args.prompt_type, seed=args.seed,
                           request_timeout_s=args.request_timeout)
    elif mode == "compile":
        from kiln.bench.compile import format_compile as fmt, plot_compile as plot, run_compile

        result = run_compile(args.levels, engine_argv(
            args, skip={"optimization_level", "cache_dir"}))
    elif mode == "quality":
        from kiln.bench.quality import format_quality as fmt, plot_quality as plot, run_quality

        def make(model: str | None, quantization: str) -> Any:
            return make_llm(argparse.Namespace(**{**vars(args), "model": model,
                                                  "quantization": quantization}))

        result = run_quality(make, args.model, args.methods, args.window, args.max_tokens,
                             args.max_windows)
    elif mode == "sampling":
        from kiln.bench.chat_defaults import format_chat_defaults as fmt, run_chat_defaults

        result = run_chat_defaults(make_llm(args), args.max_tokens, args.seeds)
        plot = _no_plots
    elif mode == "lora":
        from kiln.bench.lora import format_lora as fmt, plot_lora as plot, run_lora

        def make_lora(enable: bool) -> Any:
            extra = {"enable_lora": enable, "max_loras": args.num_adapters,
                     "max_cpu_loras": args.num_adapters, "max_lora_rank": args.rank}
            return make_llm(argparse.Namespace(**{**vars(args), **extra}))

        result = run_lora(make_lora, args.num_prompts, args.input_len, args.output_len,
                          args.num_adapters, args.rank, args.repeats)
    elif mode == "structured":
        from kiln.bench.structured import (format_structured as fmt, plot_structured as plot,
                                           run_structured)

        result = run_structured(make_llm(args), args.num_prompts, args.output_len,
                                args.repeats)
    elif mode == "spec":
        from kiln.bench.spec import (DEFAULT_SPEC, format_spec as fmt, plot_spec as plot,
                                     run_spec)

        spec = args.speculative_config or json.dumps(DEFAULT_SPEC)

        def make_spec(on: bool) -> Any:
            return make_llm(argparse.Namespace(
                **{**vars(args), "speculative_config": spec if on else None}))

        result = run_spec(make_spec, args.output_len, args.repeats)
    elif mode == "budget":
        from kiln.bench.budget import format_budget as fmt

        result = _budget(args)
        plot = _no_plots
    elif mode == "hybrid-kv":
        from kiln.bench.hybrid_kv import format_hybrid_kv as fmt, measure_kv_blocks

        result = measure_kv_blocks(args.context, args.window, args.pattern, args.num_layers,
                                   args.output_len, args.chunk)
        plot = _no_plots
    elif mode == "moe":
        from kiln.bench.moe import format_moe as fmt, run_moe

        result = run_moe(args.optimization_level, args.dtype, args.batch_sizes,
                         args.input_len, args.output_len, args.repeats)
        plot = _no_plots
    elif mode == "soak":
        import shlex

        from kiln.bench.soak import format_soak as fmt, plot_soak as plot, run_soak

        if args.duration_s <= 0 or args.clients < 1:
            raise ValueError("--duration-s must be positive and --clients at least 1")
        result = run_soak(args.model, args.duration_s, args.clients, lora=not args.no_lora,
                          spec=not args.no_ngram, kv_tier=not args.no_kv_tier,
                          serve_args=shlex.split(args.serve_args))
    elif mode in ("kv", "pd"):
        from kiln.bench.kv import format_kv, format_pd, run_kv, run_pd

        argv = engine_argv(args, skip=set())
        if mode == "kv":
            fmt, result = format_kv, run_kv(argv, args.prefix_len, args.repeats)
        else:
            fmt, result = format_pd, run_pd(argv, args.num_prompts, args.input_len,
                                            args.output_len, args.max_concurrency,
                                            split_cpus=not args.shared_cpus)
        plot = _no_plots
    else:
        from kiln.bench.kernels import format_kernels as fmt, plot_kernels as plot
        from kiln.bench.shapes import run_kernels_for_model

        result = run_kernels_for_model(args)
    print(fmt(result))
    if args.json:
        from kiln.bench.report import write_json

        print(f"wrote {write_json(args.json, result)}")
    if args.plot:
        for path in plot(result, Path(args.plot)):
            print(f"wrote {path}")
    if mode == "soak":
        return 0 if all(result["checks"].values()) else 1
    return 1 if mode == "serve" and result["completed"] == 0 else 0


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    """`kiln bench budget`: measure, then (unless --no-write) record the choice under
    the key the engine looks up for the same flags."""
    from kiln.bench.budget import run_budget
    from kiln.bench.tuning import merge_into
    from kiln.config.engine import parse_dtype
    from kiln.ops.tuning import BUDGET_OP, budget_key, default_tuning_path
    from kiln.platforms import device_name

    def make(budget: int) -> Any:
        return make_llm(argparse.Namespace(**{**vars(args), "max_num_batched_tokens": budget}))

    result = run_budget(make, args.candidates, args.prompt_len, args.decode_rows,
                        args.threshold, args.repeats, args.seed)
    result["key"] = budget_key(args.model, parse_dtype(args.dtype), args.quantization)
    result["tuning_file"] = None
    if args.write:
        entry = {"best": str(result["best"]), "config": None,
                 "us": {b: r["prefill_s"] * 1e6 for b, r in result["runs"].items()}}
        device = device_name(result["config"]["device"])
        result["tuning_file"] = str(merge_into(default_tuning_path(), device,
                                               {BUDGET_OP: {result["key"]: entry}}))
    return result


def _no_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    return []


def engine_argv(args: argparse.Namespace, skip: set[str]) -> list[str]:
    """The engine flags in `args` that differ from their defaults, as command-line words
    (for a child process that parses them with `add_engine_args`)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    words: list[str] = []
    for action in probe._actions:
        if action.dest in skip or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") \
            else action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        else:
            words += [flag, str(value)]
    return words
