"""benchmarks/peers: the measurement protocol, the worker protocol and the table, with a
fake engine. No peer is installed or run here (that takes minutes: see its README)."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import measure  # noqa: E402
import run as peers_run  # noqa: E402
from table import Row, combine, format_rounds, format_table, to_json  # noqa: E402


class FakeEngine:
    """1 s per call plus 0.1 s per step; records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.clock = 0.0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        self.calls.append((len(prompts), max_tokens))
        self.clock += 1.0 + 0.1 * max_tokens
        return len(prompts) * max_tokens


def _spec(**kw: object) -> measure.Spec:
    base = dict(model="m", dtype="float32", new_tokens=11, startup_prompt=[5],
                warmup_prompts=[[5], [6]], batch1_prompts=[[1], [2], [3], [4]],
                batchn_prompts=[[7]] * 3)
    base.update(kw)
    return measure.Spec(**base)  # type: ignore[arg-type]


def test_measure_runs_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    monkeypatch.setattr(measure.time, "perf_counter", lambda: engine.clock)
    r = measure.measure(engine, _spec(), spawned=measure.time.time())
    # startup, warm-up, 2 x (1 token, 11 tokens), then the batch of 3
    assert engine.calls == [(1, 1), (2, 4), (1, 1), (1, 11), (1, 1), (1, 11), (3, 11)]
    assert r["batch1_decode_tok_s"] == pytest.approx(10 / (2.1 - 1.1))  # (n-1)/(t_n-t_1)
    assert r["batchn_tok_s"] == pytest.approx(33 / 2.1)
    assert measure.measure(FakeEngine(), _spec(startup_only=True), 0.0).keys() == {"startup_s"}


def test_table_ratios_errors_and_busy_rows() -> None:
    rows = [Row("kiln", "auto", 60.0, 300.0, 5.0, facts={"dtype": "bfloat16"}),
            Row("vllm", "bfloat16", 40.0, 250.0, 100.0, cpu_busy_before=0.5),
            Row("transformers", "float32", error="RuntimeError: boom")]
    text = format_table(rows, 32, 128)
    assert "kiln (auto->bfloat16)" in text and "32x128 tok/s" in text
    assert "1.50x" in text and "1.20x" in text and "20.00x" in text
    assert "transformers (float32): RuntimeError: boom" in text
    assert "WARNING" in text and "vllm (bfloat16) (50%)" in text
    data = json.loads(json.dumps(to_json(rows)))
    assert data[0]["kiln_ratio"] is None
    assert data[1]["kiln_ratio"] == {"batch1_decode": 1.5, "batchn": 1.2, "startup": 20.0}


def test_rounds_combine_to_medians_and_show_each_rounds_ratio() -> None:
    """`--rounds`: one row per engine with the median over rounds, the first error of an
    engine that failed in any round, and per-round kiln/peer batch-1 ratios."""
    def rnd(kiln_b1: float, peer_b1: float, peer_error: str | None = None) -> list[Row]:
        return [Row("kiln", "auto", kiln_b1, 300.0, 5.0),
                Row("llama.cpp", "q4_1", None if peer_error else peer_b1, 70.0, 0.5,
                    error=peer_error),
                Row("transformers", "float32", 20.0, 90.0, 6.0)]

    rounds = [rnd(120.0, 80.0), rnd(160.0, 125.0), rnd(150.0, 100.0)]
    kiln, peer, hf = combine(rounds)
    assert (kiln.batch1_decode_tok_s, peer.batch1_decode_tok_s) == (150.0, 100.0)
    assert kiln.batchn_tok_s == 300.0 and peer.startup_s == 0.5
    assert len(kiln.raw["rounds"]) == 3
    assert combine(rounds[:2])[0].batch1_decode_tok_s == 140.0  # even count: the mean of two
    text = format_rounds(rounds)
    assert "llama.cpp (q4_1): 80.0 (1.50x), 125.0 (1.28x), 100.0 (1.50x)" in text
    assert "kiln (auto): 120.0, 160.0, 150.0" in text
    failed = combine([rnd(120.0, 80.0), rnd(160.0, 0.0, "exit 1")])
    assert failed[1].error == "exit 1" and failed[0].error is None


def test_worker_process_result_is_parsed(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    worker = tmp_path / "worker_fake.py"
    worker.write_text(textwrap.dedent("""
        import measure

        class E:
            def generate(self, prompts, max_tokens):
                print("noise on stdout, as engines log")
                return len(prompts) * max_tokens

        raise SystemExit(measure.run(lambda spec: (E(), {"dtype": spec.dtype})))
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PEERS), *sys.path]))
    spec = asdict(_spec())
    ok = peers_run.EngineRun("fake", "float32", str(worker))
    r = peers_run.run_process(sys.executable, ok, spec, tmp_path / "fake.log", 60, False, None)
    assert r["facts"] == {"dtype": "float32"} and r["batchn_tok_s"] > 0
    worker.write_text("import measure\nraise SystemExit(measure.run(lambda s: 1 / 0))\n")
    r = peers_run.run_process(sys.executable, ok, spec, tmp_path / "bad.log", 60, False, None)
    assert r["error"].startswith("ZeroDivisionError")
    worker.write_text("raise SystemExit(3)\n")
    r = peers_run.run_process(sys.executable, ok, spec, tmp_path / "dead.log", 60, False, None)
    assert r["error"].startswith("exit 3, no result line")
