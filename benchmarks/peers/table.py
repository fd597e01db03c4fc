"""Rows of the side-by-side comparison and their text table (no kiln, no torch imports).

A `Row` is one engine configuration's parsed worker result; a failed engine is a row with
`error` set and no numbers. Ratios are always "how many times better kiln is": for tok/s
kiln / peer, for start-up time peer / kiln. So > 1 means kiln wins in every column.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from busy import BUSY_WARN


@dataclass(slots=True)
class Row:
    engine: str                          # "kiln", "vllm", "transformers", ...
    dtype: str                           # what was asked ("auto" for kiln's default)
    batch1_decode_tok_s: float | None = None
    batchn_tok_s: float | None = None
    startup_s: float | None = None       # process spawn -> first token (measured process)
    error: str | None = None
    cpu_busy_before: float | None = None  # others' CPU use just before the measured run
    facts: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)  # the worker's whole result

    @property
    def label(self) -> str:
        real = self.facts.get("dtype")  # kiln resolves "auto"; show what it chose
        shown = f"{self.dtype}->{real}" if real and real != self.dtype else self.dtype
        return f"{self.engine} ({shown})"

    @classmethod
    def from_result(cls, engine: str, dtype: str, result: dict[str, Any]) -> "Row":
        return cls(engine=engine, dtype=dtype,
                   batch1_decode_tok_s=result.get("batch1_decode_tok_s"),
                   batchn_tok_s=result.get("batchn_tok_s"),
                   startup_s=result.get("startup_s"), error=result.get("error"),
                   facts=result.get("facts", {}), raw=result)


def combine(rounds: list[list[Row]]) -> list[Row]:
    """One row per engine configuration from `rounds` (each a list of rows in the same
    order): the median of each number over the rounds that gave one; the first error of
    an engine that failed in any round."""
    out = []
    for runs in zip(*rounds):
        first = runs[0]
        failed = next((r for r in runs if r.error), None)
        if failed is not None:
            out.append(failed)
            continue
        row = Row(engine=first.engine, dtype=first.dtype, facts=first.facts,
                  raw={"rounds": [r.raw for r in runs]},
                  cpu_busy_before=max((r.cpu_busy_before or 0) for r in runs))
        for name in ("batch1_decode_tok_s", "batchn_tok_s", "startup_s"):
            values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            setattr(row, name, statistics.median(values) if values else None)
        out.append(row)
    return out


def format_rounds(rounds: list[list[Row]]) -> str:
    """Each engine's batch-1 tok/s per round and, for the peers, kiln (the first kiln row)
    over it within the same round: engines of one round ran minutes apart, so these
    ratios see less of a host that drifts than the medians do."""
    lines = ["batch-1 decode tok/s per round (kiln / row, same round):"]
    for i in range(len(rounds[0])):
        cells = []
        for rows in rounds:
            kiln = next((r for r in rows if r.engine == "kiln" and not r.error), None)
            r = rows[i]
            q = ratios(kiln, r).get("batch1_decode") if kiln is not None and r is not kiln else None
            cells.append(_num(r.batch1_decode_tok_s) + (f" ({q:.2f}x)" if q else ""))
        lines.append(f"  {rounds[0][i].label}: " + ", ".join(cells))
    return "\n".join(lines)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(kiln: Row, peer: Row) -> dict[str, float | None]:
    return {"batch1_decode": _div(kiln.batch1_decode_tok_s, peer.batch1_decode_tok_s),
            "batchn": _div(kiln.batchn_tok_s, peer.batchn_tok_s),
            "startup": _div(peer.startup_s, kiln.startup_s)}


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_table(rows: list[Row], num_prompts: int, new_tokens: int) -> str:
    """A fixed-width table, kiln first; the ratio columns compare kiln with each row."""
    kiln = next((r for r in rows if r.engine == "kiln" and not r.error), None)
    heads = ["engine", "b1 decode tok/s", f"{num_prompts}x{new_tokens} tok/s",
             "start->1st tok s", "kiln/b1", f"kiln/{num_prompts}x", "kiln/start"]
    lines: list[list[str]] = []
    errors: list[str] = []
    busy = [r for r in rows if (r.cpu_busy_before or 0) > BUSY_WARN]
    for r in rows:
        if r.error:
            lines.append([r.label, "error", "error", "error", "-", "-", "-"])
            errors.append(f"  {r.label}: {r.error}")
            continue
        q = ratios(kiln, r) if kiln is not None and r is not kiln else {}
        lines.append([r.label, _num(r.batch1_decode_tok_s), _num(r.batchn_tok_s),
                      _num(r.startup_s), _ratio(q.get("batch1_decode")),
                      _ratio(q.get("batchn")), _ratio(q.get("startup"))])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(heads)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [fmt(heads), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines]
    if errors:
        out += ["errors:"] + errors
    if busy:
        out.append("WARNING: other processes kept the CPUs busy before "
                   + ", ".join(f"{r.label} ({r.cpu_busy_before:.0%})" for r in busy)
                   + ": those numbers are distorted (see busy.py); rerun on a quiet machine.")
    return "\n".join(out)


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    kiln = next((r for r in rows if r.engine == "kiln" and not r.error), None)
    out = []
    for r in rows:
        d = asdict(r)
        d["kiln_ratio"] = ratios(kiln, r) if kiln is not None and r is not kiln else None
        out.append(d)
    return out
