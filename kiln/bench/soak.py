"""`kiln bench soak`: a long mixed load on one real `kiln serve`, features on together.

The harness starts `kiln serve` on the model (the default one unless `--model`) with a
random LoRA adapter, n-gram speculation and the disk KV tier on (each can be turned
off), then runs `--clients` clients of the real `openai` client for `--duration-s`. Each
client walks the request kinds in turn (`KINDS`): chat, streamed chat, `n=2` with
logprobs, a JSON schema, `tool_choice="required"`, the adapter, stop strings, a stream
dropped after two chunks, and hostile requests (which must be refused with a 4xx).
It samples the server's resident memory, asks one greedy reference question before the
load and after it, and once the clients stop waits for the server to drain.

The verdict's checks: no 5xx, no unexpected error, every constrained answer valid (an
answer cut by max_tokens counts as truncated, not invalid), drained to 0 running /
0 waiting / 0 KV usage, resident memory after the first minute (or the first sixth of a
shorter run) grown by at most 5%, and the reference answer identical.
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.bench.report import environment, table
from kiln.bench.server_proc import ServerProcess
from kiln.bench.stats import summarize
from kiln.bench.soak_requests import KINDS, REFERENCE, Outcome, Target, send

ADAPTER = "soak-adapter"
MAX_RSS_GROWTH = 0.05


def serve_argv(model: str | None, workdir: Path, lora: bool, spec: bool, kv_tier: bool,
               extra: list[str]) -> list[str]:
    """`kiln serve`'s words for the features asked for (a random adapter written into
    `workdir` for the model's shapes)."""
    argv = [model] if model else []
    if lora:
        from kiln.bench.lora import write_random_adapter
        from kiln.models.model_config import ModelConfig
        from kiln.models.model_source import resolve_model

        mc = ModelConfig.from_pretrained(resolve_model(model, progress=False))
        path = write_random_adapter(mc, workdir / "adapter", rank=8, seed=0)
        argv += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                 f"{ADAPTER}={path}"]
    if spec:
        argv += ["--speculative-config", json.dumps({"method": "ngram",
                                                     "num_speculative_tokens": 3})]
    if kv_tier:
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "disk", "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": str(workdir / "kv-tier")}})]
    return argv + extra


def run_soak(model: str | None, duration_s: float, clients: int, *, lora: bool = True,
             spec: bool = True, kv_tier: bool = True, serve_args: list[str] | None = None,
             rss_interval_s: float = 5.0, startup_timeout_s: float = 600.0
             ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kiln-soak-") as tmp:
        work = Path(tmp)
        argv = serve_argv(model, work, lora, spec, kv_tier, serve_args or [])
        # The whole KV cache backed at start-up: it is otherwise backed as requests first
        # reach its pages (about a GiB over the first minutes here), which is not growth.
        server = ServerProcess(argv, work / "server.log", env={"KILN_KV_PREFAULT": "all"})
        try:
            server.wait_ready(startup_timeout_s)
            result = asyncio.run(_soak(server, duration_s, clients,
                                       ADAPTER if lora else None, rss_interval_s))
        except BaseException:
            print(server.log.read_text(errors="replace")[-3000:])
            raise
        finally:
            server.stop()
    result["config"] = {"model": model or "default", "duration_s": duration_s,
                        "clients": clients, "lora": lora, "ngram": spec, "kv_tier": kv_tier,
                        "serve_argv": argv}
    result["environment"] = environment()
    result["checks"] = _checks(result)
    return result


async def _soak(server: ServerProcess, duration_s: float, clients: int,
                adapter: str | None, rss_interval_s: float) -> dict[str, Any]:
    import httpx
    import openai

    api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                             timeout=300)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        card = (await api.models.list()).data[0]
        model = card.id
        target = Target(model, adapter, (card.model_extra or {}).get("max_model_len", 32768))
        # Asked twice before the load: the first fills the prefix cache and the tier, so
        # "before" and "after" both run with the prompt's blocks cached, and differ only
        # if the load left the engine in another state (bf16 prefill is not the same
        # computation with and without cached blocks, and may pick other tokens).
        cold = await _reference(api, model)
        before = await _reference(api, model)
        outcomes: list[Outcome] = []
        rss: list[tuple[float, float]] = []
        start = time.monotonic()
        deadline = start + duration_s
        sampler = asyncio.create_task(_sample_rss(server, start, deadline, rss_interval_s,
                                                  rss))
        await asyncio.gather(*(_client(i, api, http, target, deadline, outcomes)
                               for i in range(clients)))
        elapsed = time.monotonic() - start
        await sampler
        drained = await asyncio.to_thread(_wait_drained, server, 120.0)
        after = await _reference(api, model)
    return {"elapsed_s": elapsed, "kinds": _by_kind(outcomes), "rss_mib": rss,
            "rss_growth": _growth(rss, duration_s),
            "errors": [o.error for o in outcomes if o.unexpected][:10],
            "status_5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
            "drained": drained, "reference": {"cold": cold, "before": before, "after": after,
                                              "identical": before == after}}


async def _client(index: int, api: Any, http: Any, target: Target, deadline: float,
                  outcomes: list[Outcome]) -> None:
    kinds = [k for k in KINDS if target.adapter is not None or k != "adapter"]
    turn = index  # each client starts at another kind
    while time.monotonic() < deadline:
        kind = kinds[turn % len(kinds)]
        outcomes.append(await send(kind, api, http, target, turn))
        turn += 1


async def _reference(api: Any, model: str) -> str:
    r = await api.chat.completions.create(model=model, messages=REFERENCE, temperature=0,
                                          max_tokens=48)
    return r.choices[0].message.content or ""


async def _sample_rss(server: ServerProcess, start: float, deadline: float,
                      interval_s: float, out: list[tuple[float, float]]) -> None:
    while True:
        now = time.monotonic()
        value = server.rss_bytes()
        if value is not None:
            out.append((round(now - start, 1), round(value / 2**20, 1)))
        if now >= deadline:
            return
        await asyncio.sleep(min(interval_s, max(0.0, deadline - now)))


def _wait_drained(server: ServerProcess, timeout_s: float) -> dict[str, float]:
    names = ("kiln:num_requests_running", "kiln:num_requests_waiting",
             "kiln:kv_cache_usage_perc")
    end = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        state = {n.removeprefix("kiln:"): m.get(n, float("nan")) for n in names}
        if all(v == 0 for v in state.values()) or time.monotonic() > end:
            return state
        time.sleep(0.2)


def _by_kind(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        out[kind] = {"sent": len(mine), "ok": sum(o.ok for o in mine),
                     "refused_as_meant": sum(o.refused for o in mine),
                     "unexpected": sum(o.unexpected for o in mine),
                     "invalid": sum(o.invalid for o in mine),
                     "truncated": sum(o.truncated for o in mine),
                     "latency_ms": summarize([1e3 * o.latency_s for o in mine])}
    return out


def _growth(rss: list[tuple[float, float]], duration_s: float) -> float | None:
    """Resident memory at the end over its value once warm (after the first minute, or
    the first sixth of a shorter run), minus one."""
    warm_at = min(60.0, duration_s / 6)
    warm = [mib for t, mib in rss if t >= warm_at]
    return None if len(warm) < 2 else warm[-1] / warm[0] - 1


def _checks(r: dict[str, Any]) -> dict[str, bool]:
    kinds = r["kinds"].values()
    growth = r["rss_growth"]
    return {"no 5xx": r["status_5xx"] == 0,
            "no unexpected error": sum(k["unexpected"] for k in kinds) == 0,
            "constrained answers valid": sum(k["invalid"] for k in kinds) == 0,
            "drained": all(v == 0 for v in r["drained"].values()),
            f"memory growth <= {MAX_RSS_GROWTH:.0%}": growth is not None
            and growth <= MAX_RSS_GROWTH,
            "reference identical": r["reference"]["identical"]}


def format_soak(r: dict[str, Any]) -> str:
    c = r["config"]
    rows = [[kind, k["sent"], k["ok"], k["refused_as_meant"], k["unexpected"], k["invalid"],
             k["truncated"], f"{k['latency_ms']['p50']:.0f}", f"{k['latency_ms']['p99']:.0f}"]
            for kind, k in r["kinds"].items()]
    head = (f"soak: {c['model']} for {r['elapsed_s']:.0f} s, {c['clients']} clients; LoRA "
            f"{c['lora']}, n-gram {c['ngram']}, disk KV tier {c['kv_tier']}")
    body = table(["kind", "sent", "ok", "refused (meant)", "unexpected", "invalid",
                  "truncated", "p50 ms", "p99 ms"], rows)
    rss = r["rss_mib"]
    mem = (f"resident memory {rss[0][1]:.0f} -> {rss[-1][1]:.0f} MiB; after warm-up "
           f"{100 * r['rss_growth']:+.1f}%" if rss and r["rss_growth"] is not None
           else "resident memory: too few samples")
    checks = "\n".join(f"  [{'ok' if v else 'FAIL'}] {k}" for k, v in r["checks"].items())
    errors = "".join(f"\n  error: {e}" for e in r["errors"])
    return (f"{head}\n{body}\n5xx {r['status_5xx']}; drained {r['drained']}\n{mem}\n"
            f"reference answer identical: {r['reference']['identical']}\n{checks}{errors}")


def plot_soak(r: dict[str, Any], out_dir: Path) -> list[Path]:
    from kiln.bench import plots

    times = [t for t, _ in r["rss_mib"]]
    mib = [m for _, m in r["rss_mib"]]
    return [plots.line(times, {"resident MiB": mib}, "kiln serve under the soak",
                       "seconds", "MiB", out_dir / "soak_rss.png")]
