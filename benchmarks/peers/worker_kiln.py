"""kiln worker: `python worker_kiln.py SPEC.json` with kiln importable.

The engine is built exactly as `kiln generate` builds it: the CLI's own engine flags and
defaults (so "kiln's default configuration" follows the CLI: default -O level,
`--dtype auto`), plus whatever extra flags the orchestrator passes in
`spec.options["argv"]`. kiln has no public "parse engine flags" API yet, so this borrows
the CLI's parser the way `kiln.bench.startup_probe` does.
"""
from __future__ import annotations

import argparse
from typing import Any

import measure


class KilnEngine:
    def __init__(self, llm: Any) -> None:
        from kiln import SamplingParams

        self.llm = llm
        self._params = SamplingParams

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        for o in outs:
            if getattr(o, "error", None):
                raise RuntimeError(f"kiln rejected a request: {o.error}")
        return sum(len(o.outputs[0].token_ids) for o in outs)


def make_engine(spec: measure.Spec) -> tuple[KilnEngine, dict[str, Any]]:
    from kiln.bench.report import engine_facts, environment
    from kiln.entrypoints.args import add_engine_args, make_llm

    parser = argparse.ArgumentParser(prog="worker_kiln")
    add_engine_args(parser)
    argv = ["--model", spec.model] + list(spec.options.get("argv", []))
    if spec.dtype:
        argv += ["--dtype", spec.dtype]
    llm = make_llm(parser.parse_args(argv))
    facts = {"engine": "kiln", **environment(), **engine_facts(llm.engine), "argv": argv}
    return KilnEngine(llm), facts


if __name__ == "__main__":
    raise SystemExit(measure.run(make_engine))
