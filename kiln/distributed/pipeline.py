"""Pipeline stages: which contiguous layers a pipeline rank holds.

The first stage embeds, the last holds the final norm and the LM head (and samples); the
hidden states pass between stages. Layers split evenly by default; the layers left over
go to the stages before the last, from the last but one backwards (the last stage also
computes the logits), as vLLM's `get_pp_indices` does. `KILN_PP_LAYER_PARTITION="5,4"`
(or vLLM's VLLM_PP_LAYER_PARTITION) sets them explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln import envs
from kiln.distributed.parallel_state import get_pp_group


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This rank's stage: layers [start, end) of the model's `num_layers`."""

    rank: int
    size: int
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def cache_key(self) -> list[int]:
        return [self.rank, self.size, self.start, self.end]


def layer_partition(num_layers: int, pp: int, spec: str | None = None) -> list[int]:
    """Layers per stage. `spec` (default: KILN_PP_LAYER_PARTITION) overrides the even
    split; a bad one raises ValueError naming the variable."""
    spec = envs.KILN_PP_LAYER_PARTITION if spec is None else spec
    if spec:
        try:
            parts = [int(p) for p in spec.split(",")]
        except ValueError:
            raise ValueError(f"KILN_PP_LAYER_PARTITION={spec!r} must be comma-separated "
                             "layer counts, e.g. '5,4'") from None
        if len(parts) != pp or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"KILN_PP_LAYER_PARTITION={spec!r} must give each of the "
                             f"{pp} pipeline stages at least one layer and sum to the "
                             f"model's {num_layers} layers")
        return parts
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} "
                         "layers: every stage needs at least one; lower -pp")
    parts = [num_layers // pp] * pp
    for i in range(num_layers % pp):  # the last but one first, backwards
        parts[(pp - 2 - i) % pp] += 1
    return parts


def pipeline_stage(num_layers: int) -> PipelineStage:
    """This process's stage (the whole model without pipeline parallelism)."""
    group = get_pp_group()
    parts = layer_partition(num_layers, group.world_size) if group.world_size > 1 \
        else [num_layers]
    start = sum(parts[: group.rank])
    return PipelineStage(group.rank, group.world_size, start, start + parts[group.rank])
