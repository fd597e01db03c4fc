"""The engine flags every command shares (`kiln generate | chat | serve | warmup | bench`,
and the harnesses in `benchmarks/`), and the LLM and sampling parameters they make.

Public, so a harness adds exactly the flags a user types: `add_engine_args(parser)` then
`make_llm(parser.parse_args())`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kiln.config.engine import EngineConfig
from kiln.lora.request import LoRARequest
from kiln.sampling.defaults import with_defaults
from kiln.sampling.params import SamplingParams
from kiln.structured_output.params import StructuredOutputsParams


def default_of(name: str) -> Any:
    return EngineConfig.__dataclass_fields__[name].default


def add_engine_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--max-num-seqs", type=int, default=default_of("max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (the chunked-prefill budget; default: the "
                        "budget `kiln bench budget` measured for this model on this host, "
                        f"else {default_of('max_num_batched_tokens')})")
    p.add_argument("--block-size", type=int, default=default_of("block_size"))
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--attention-backend", default=None,
                   help="cpu | torch | triton (default: triton on CUDA; on a CPU, cpu where "
                        "kiln's C++ kernels build, else torch)")
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
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="split the layers into N stages, one process (group) each; "
                        "KILN_PP_LAYER_PARTITION='5,4' sets the layers per stage")
    p.add_argument("--distributed-executor-backend", default=None,
                   choices=["uni", "mp", "ray", "external_launcher"],
                   help="who runs the ranks: uni (in process, tp=1), mp (one process per "
                        "rank; the default for tp or pp > 1), ray (an actor per rank on a "
                        "Ray cluster: RAY_ADDRESS, else a local one), external_launcher "
                        "(torchrun)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (slots on every decoder linear)")
    p.add_argument("--max-loras", type=int, default=default_of("max_loras"), metavar="N",
                   help="distinct adapters one step may run (device slots; default 1)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="M",
                   help="adapters kept loaded behind the slots, LRU (default: --max-loras)")
    p.add_argument("--max-lora-rank", type=int, default=default_of("max_lora_rank"),
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
    p.add_argument("--generation-config", default="auto", metavar="auto|kiln|PATH",
                   help="default sampling parameters for requests that do not set them: "
                        "auto (the model's generation_config.json; default), kiln (kiln's "
                        "own defaults), or a folder holding a generation_config.json")
    p.add_argument("--io-processor-plugin", default=None, metavar="NAME",
                   help="an installed kiln.io_processor_plugins entry: LLM.process and "
                        "the server's POST /process use it (default: the model "
                        "config.json's io_processor_plugin, if any)")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="generation-config keys laid over the source, e.g. "
                        "'{\"repetition_penalty\": 1.1, \"temperature\": 0}'")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-path", default=None, metavar="DIR",
                   help="run the prompts with this PEFT LoRA adapter (turns LoRA on)")
    p.add_argument("--lora-name", default=None,
                   help="the adapter's name (default: the directory's name)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # None: unset, so the model's generation config (then CLI_DEFAULTS) decides.
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: the generation config's max_new_tokens, else 64")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the generation config's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: the generation config's, else 1 (off)")
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


def make_llm(args: argparse.Namespace) -> Any:
    # Imported here: the engine (and xgrammar below) cost seconds to import, and commands
    # such as `kiln cache ls` or `--help` build no engine.
    from kiln.entrypoints.llm import LLM

    return LLM(args.model, dtype=args.dtype, optimization_level=args.optimization_level,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
               attention_backend=args.attention_backend, seed=args.seed,
               compilation=compilation_fields(args),
               enable_prefix_caching=not args.no_prefix_caching,
               scheduling_policy=args.scheduling_policy,
               long_prefill_token_threshold=args.long_prefill_token_threshold,
               tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size,
               distributed_executor_backend=args.distributed_executor_backend,
               quantization=args.quantization, enable_lora=args.enable_lora,
               max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
               max_lora_rank=args.max_lora_rank,
               speculative_config=args.speculative_config,
               kv_transfer_config=args.kv_transfer_config,
               generation_config=args.generation_config,
               io_processor_plugin=args.io_processor_plugin,
               override_generation_config=args.override_generation_config)


def lora_request(args: argparse.Namespace) -> LoRARequest | None:
    """The adapter of --lora-path (id 1), or None; turns LoRA on when there is one."""
    if args.lora_path is None:
        if args.lora_name is not None:
            raise ValueError("--lora-name needs --lora-path DIR (the adapter directory)")
        return None
    args.enable_lora = True
    name = args.lora_name or Path(args.lora_path).resolve().name
    return LoRARequest(name, 1, args.lora_path)


def compilation_fields(args: argparse.Namespace) -> dict[str, Any]:
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


# What the CLI uses where neither a flag nor the generation config sets a field: greedy,
# so a command's answer is reproducible unless asked otherwise.
CLI_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "max_tokens": 64}


_PARSE: Any = object()  # sampling_params: parse the constraint flags


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any] | None = None,
                    structured: Any = _PARSE) -> SamplingParams:
    """The flags' SamplingParams: a flag given wins, then `defaults` (the engine's
    generation config, `LLMEngine.default_sampling`), then CLI_DEFAULTS. `structured`: a
    constraint already parsed from these flags (its grammar is compiled once)."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
             "max_tokens": args.max_tokens}
    if structured is _PARSE:
        structured = structured_params(args)
    fields = with_defaults({**CLI_DEFAULTS, **(defaults or {})}, given,
                           constrained=structured is not None)
    return SamplingParams(
        n=getattr(args, "n", 1), presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos, seed=args.seed, structured_outputs=structured, **fields)


def structured_params(args: argparse.Namespace) -> Any:
    """--json-schema / --json-object / --regex / --choice / --grammar, checked now."""
    fields = {"json": _read_file(args.json_schema, "--json-schema"),
              "json_object": args.json_object or None, "regex": args.regex,
              "choice": args.choice, "grammar": _read_file(args.grammar, "--grammar")}
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --json-object, --regex, --choice, "
                         "--grammar")
    # Imported only for a constraint: xgrammar's import is 1.1 s of every command's start.
    from kiln.structured_output.backend import grammar_for

    params = StructuredOutputsParams(**given)
    grammar_for(params)  # a bad schema, regex or grammar fails before the model loads
    return params


def _read_file(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
