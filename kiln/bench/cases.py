"""What `kiln bench kernels` times: one `Case` per (op, shape), each with its candidate
implementations. The first candidate is the reference the others must match.

Shapes come from the model config: token counts are the decode batch sizes and the
prefill lengths; widths are the model's hidden, intermediate, head and vocabulary sizes.
Other modules can add candidates for an op with `register_candidate` (a Triton kernel,
say); attention candidates are every backend in the selector's registry that `supports()`
this head size, dtype and device (see kernel_attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kiln.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from kiln.ops import pointwise
from kiln.ops.tuning import shape_key
from kiln.sampling.sampler import apply_top_k_top_p


@dataclass(slots=True)
class Candidate:
    name: str
    run: Callable[[], Any]  # one call of the op on the case's inputs; returns its output
    config: dict[str, Any] | None = None  # kernel launch parameters, when swept

    @property
    def label(self) -> str:
        if not self.config:
            return self.name
        return f"{self.name}[{','.join(f'{k}={v}' for k, v in self.config.items())}]"


@dataclass(slots=True)
class Case:
    op: str
    key: str  # tuning.shape_key(...) of this shape
    candidates: list[Candidate]
    compare: Callable[[Any, Any], str | None] = field(default=lambda a, b: close(a, b))


@dataclass(frozen=True, slots=True)
class Shapes:
    """The widths of one model and the token counts to tune for."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    decode_batches: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    context_len: int  # tokens already in the KV cache of each decoding request
    dtype: torch.dtype
    device: torch.device
    moe: tuple[int, int, int] | None = None  # (experts, top_k, intermediate per expert)

    @property
    def token_counts(self) -> list[int]:
        return sorted(set(self.decode_batches) | set(self.prefill_lens))


# op -> name -> factory(shapes, inputs) -> callable. Inputs are the reference's inputs.
_EXTRA: dict[str, dict[str, Callable[..., Callable[[], Any]]]] = {}


def register_candidate(op: str, name: str, factory: Callable[..., Callable[[], Any]]) -> None:
    """Add an implementation of `op` (e.g. a Triton kernel); `factory(shapes, **inputs)`
    returns a zero-argument callable computing the op on those inputs."""
    _EXTRA.setdefault(op, {})[name] = factory


def close(a: Any, b: Any, tol: float | None = None) -> str | None:
    """None if the outputs match (tensors or tuples of them), else what differs."""
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            if (err := close(x, y, tol)) is not None:
                return err
        return None
    tol = tol or (1e-4 if a.dtype == torch.float32 else 3e-2)
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} != {tuple(a.shape)}"
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, a.float().abs().max().item() if a.numel() else 0.0)
    return None if diff <= tol * scale else f"max abs diff {diff:.3g} > {tol * scale:.3g}"


def _compiled(fn: Callable[..., Any], shapes: Shapes) -> list[tuple[str, Callable[..., Any]]]:
    """torch.compile variants of `fn`, dynamic in the token dimension (one build serves
    every shape, as in kiln's compiled pieces). On CUDA, max-autotune makes Inductor sweep
    its Triton templates (block sizes, warps, stages) and keep the fastest."""
    out = [("inductor", torch.compile(fn, dynamic=True))]
    if shapes.device.type == "cuda":
        out.append(("inductor-autotune",
                    torch.compile(fn, dynamic=True, mode="max-autotune-no-cudagraphs")))
    return out


def _kiln_kernel(name: str, fn: Callable[..., Any], shapes: Shapes
                 ) -> list[tuple[str, Callable[..., Any]]]:
    """The model layer's own path where it runs kiln's CPU kernel (csrc/pointwise.cpp);
    elsewhere it is the "eager" expression already listed."""
    probe = torch.empty(0, device=shapes.device, dtype=shapes.dtype)
    return [(name, fn)] if pointwise.kernel_applies(probe) else []


def _with_extras(op: str, base: list[Candidate], shapes: Shapes, **inputs: Any
                 ) -> list[Candidate]:
    return base + [Candidate(name, factory(shapes, **inputs))
                   for name, factory in _EXTRA.get(op, {}).items()]


def rms_norm_cases(s: Shapes, compiled: bool) -> list[Case]:
    norm = RMSNorm(s.hidden, s.eps).to(s.device, s.dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def fused(x: torch.Tensor) -> torch.Tensor:
        # The same rounding points as RMSNorm: normalise in float32, scale in x's dtype.
        return norm.weight * F.rms_norm(x.float(), (s.hidden,), eps=s.eps).to(x.dtype)

    variants = [("eager", norm), ("torch-rms-norm", fused)]
    variants += _compiled(norm.forward, s) if compiled else []
    cases = []
    for t in s.token_counts:
        x = torch.randn(t, s.hidden, device=s.device, dtype=s.dtype)
        zero = torch.zeros_like(x)
        # The model's path, kiln_cpu::add_rms_norm, also adds the residual (here a zero
        # one): it does more than the others.
        kiln = _kiln_kernel("kiln-add", lambda x, z=zero: norm.forward_add(x, z)[1], s)
        base = [Candidate(n, (lambda f=f, x=x: f(x))) for n, f in variants + kiln]
        cases.append(Case("rms_norm", shape_key(tokens=t, hidden=s.hidden, dtype=s.dtype),
                          _with_extras("rms_norm", base, s, x=x, weight=norm.weight)))
    return cases


def rope_cases(s: Shapes, compiled: bool) -> list[Case]:
    rope = RotaryEmbedding(s.head_dim, s.max_positions, s.rope_theta, None).to(s.device)
    half = s.head_dim // 2

    def halves(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # No rotate_half copy: each half is rotated in place of the concatenation.
        cos = rope.cos[positions, :half].unsqueeze(1).to(q.dtype)
        sin = rope.sin[positions, :half].unsqueeze(1).to(q.dtype)

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return rot(q), rot(k)

    def native(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return pointwise.rotary_neox_native(positions, q, k, rope.cos, rope.sin)

    variants = [("eager", native), ("split-halves", halves)]
    variants += _kiln_kernel("kiln", rope.forward, s)
    variants += _compiled(native, s) if compiled else []
    cases = []
    for t in s.token_counts:
        pos = torch.randint(0, s.max_positions, (t,), device=s.device)
        q = torch.randn(t, s.num_heads, s.head_dim, device=s.device, dtype=s.dtype)
        k = torch.randn(t, s.num_kv_heads, s.head_dim, device=s.device, dtype=s.dtype)
        base = [Candidate(n, (lambda f=f, pos=pos, q=q, k=k: f(pos, q, k)))
                for n, f in variants]
        key = shape_key(tokens=t, heads=s.num_heads, kv_heads=s.num_kv_heads,
                        head_size=s.head_dim, dtype=s.dtype)
        cases.append(Case("rope", key, _with_extras("rope", base, s, positions=pos, q=q, k=k,
                                                    cos=rope.cos, sin=rope.sin)))
    return cases


def silu_and_mul_cases(s: Shapes, compiled: bool) -> list[Case]:
    act, inter = SiluAndMul(), s.intermediate

    def sliced(x: torch.Tensor) -> torch.Tensor:
        return F.silu(x[:, :inter]) * x[:, inter:]

    variants = [("eager", pointwise.silu_and_mul_native), ("slice", sliced)]
    variants += _kiln_kernel("kiln", act.forward, s)
    variants += _compiled(pointwise.silu_and_mul_native, s) if compiled else []
    cases = []
    for t in s.token_counts:
        x = torch.randn(t, 2 * inter, device=s.device, dtype=s.dtype)
        base = [Candidate(n, (lambda f=f, x=x: f(x))) for n, f in variants]
        cases.append(Case("silu_and_mul", shape_key(tokens=t, intermediate=inter,
                                                    dtype=s.dtype),
                          _with_extras("silu_and_mul", base, s, x=x)))
    return cases


def top_k_top_p_topk(logits: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """The sampler's top-k/top-p mask from a partial `topk` instead of a full-vocabulary
    sort. Valid when every row has 0 < top_k <= vocab (the case built below)."""
    k_max = int(top_k.max())
    values, order = logits.topk(k_max, dim=-1)  # sorted, descending
    drop = torch.arange(k_max, device=logits.device).unsqueeze(0) >= top_k.unsqueeze(1)
    probs = values.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter_(-1, order, values.masked_fill(drop, float("-inf")))


def _same_mask(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if not torch.equal(torch.isinf(a), torch.isinf(b)):
        return "different tokens kept"
    return close(a.nan_to_num(neginf=0.0), b.nan_to_num(neginf=0.0))


def sampler_cases(s: Shapes, compiled: bool) -> list[Case]:
    """Top-k (50) + top-p (0.9) filtering of float32 logits, the sampler's costly step."""
    cases = []
    for b in s.decode_batches:
        logits = torch.randn(b, s.vocab, device=s.device) * 3
        top_k = torch.full((b,), min(50, s.vocab), device=s.device, dtype=torch.int64)
        top_p = torch.full((b,), 0.9, device=s.device)
        base = [Candidate("sort", lambda lg=logits, k=top_k, p=top_p: apply_top_k_top_p(lg, k, p)),
                Candidate("topk", lambda lg=logits, k=top_k, p=top_p: top_k_top_p_topk(lg, k, p))]
        cases.append(Case("top_k_top_p", shape_key(batch=b, vocab=s.vocab, top_k=50),
                          _with_extras("top_k_top_p", base, s, logits=logits, top_k=top_k,
                                       top_p=top_p), compare=_same_mask))
    return cases
