"""CPU weights on transparent huge pages (kiln/runner/huge_pages.py): the move keeps every
value and every tensor object, skips storages it cannot move whole, and the kernel really
backs the arena with 2 MiB pages where THP is on; the KV cache's zeros are lazy and on
4 KiB pages, its first blocks backed at start-up and the rest by the backfill
(kiln/runner/kv_backing.py), which changes no byte the engine wrote."""
from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch
from torch import nn

from kiln.runner import huge_pages
from kiln.runner.huge_pages import HUGE_PAGE, move_weights_to_huge_pages
from kiln.runner.kv_backing import lazy_zeros

needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason=f"transparent huge pages are {huge_pages.thp_mode()}")


def smaps_kib(address: int, field: str) -> int:
    """A field (`AnonHugePages`, `Rss`) of the mapping holding `address`, from
    /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def anon_huge_kib(address: int) -> int:
    return smaps_kib(address, "AnonHugePages")


def resident_kib(t: torch.Tensor) -> int:
    """KiB of the pages under `t`'s own bytes that are backed (mincore over exactly that
    range). Not smaps' Rss: it counts the whole mapping, and the kernel merges a fresh
    anonymous mapping with an adjacent one of the same flags, such as the KV cache of an
    engine an earlier test in this worker left alive (Rss once read twice the pages)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    flags = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags):
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(f & 1 for f in flags) * page // 1024


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 512)  # 2 MiB fp32
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, moved once
        self.proj = nn.Linear(512, 512)
        self.small = nn.Linear(8, 8)  # under the size floor: stays
        base = torch.randn(512, 256)
        self.register_buffer("whole", base)
        self.register_buffer("part", base[:128])  # views part of `whole`'s storage
        big = torch.randn(512, 256)
        self.register_buffer("big", big)
        self.register_buffer("tiny_view", big[0, :4])  # small, yet it pins `big` in place


@needs_thp
def test_weights_move_to_one_huge_page_arena_keeping_values_and_objects():
    # A freed 20 MiB block raises glibc's mmap threshold, and freed 4 MiB blocks then
    # leave touched pages in its heap: a 3 MiB arena from malloc would reuse them and get
    # no huge pages (seen in a full test run), so the arena must be a mapping of its own.
    block = torch.ones(20 << 20, dtype=torch.uint8)
    del block
    used = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(6)]
    del used
    torch.manual_seed(0)
    m = Tied()
    before = {n: t.clone() for n, t in m.state_dict().items()}
    objects = {n: t for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    ptrs = {n: t.data_ptr() for n, t in objects.items()}
    x = torch.randint(0, 1024, (4,))
    expected = m.head(m.proj(m.embed(x)))

    moved = move_weights_to_huge_pages(m)

    assert moved >= (1024 * 512 + 512 * 512) * 4
    for n, t in list(m.named_parameters()) + list(m.named_buffers()):
        assert t is objects[n] and torch.equal(t, before[n]), n
    assert m.head.weight is m.embed.weight
    assert m.embed.weight.data_ptr() != ptrs["embed.weight"]
    assert m.proj.weight.data_ptr() != ptrs["proj.weight"]
    # One mapping, yet a storage per weight: a compiled region's inputs may not alias.
    assert (m.embed.weight.untyped_storage().data_ptr()
            != m.proj.weight.untyped_storage().data_ptr())
    # Too small, or sharing a storage some tensor views only in part: not moved.
    for name in ("small.weight", "whole", "part", "big", "tiny_view"):
        assert objects[name].data_ptr() == ptrs[name], name
    assert torch.equal(m.head(m.proj(m.embed(x))), expected)
    # The arena starts on a huge-page boundary and the kernel backs it with huge pages.
    start = m.embed.weight.data_ptr()
    assert start % HUGE_PAGE == 0
    assert anon_huge_kib(start) >= HUGE_PAGE // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")
def test_kv_cache_zeros_are_lazy_and_on_small_pages():
    t = lazy_zeros((2, 3, 1 << 20), torch.bfloat16)
    assert t.shape == (2, 3, 1 << 20) and t.dtype == torch.bfloat16 and not t.any()
    # Nothing wrote the zeros, and a write backs 4 KiB pages, never a huge one (a huge-page
    # fault may compact memory first: milliseconds a page under a new prompt).
    assert t.data_ptr() % 4096 == 0
    t[0, 0, : 1 << 19] = 1.0
    assert anon_huge_kib(t.data_ptr()) == 0
    assert t[0, 0, : 1 << 19].eq(1).all() and not t[1].any()


def test_nothing_moves_without_transparent_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    m = nn.Linear(512, 512)
    ptr = m.weight.data_ptr()
    assert move_weights_to_huge_pages(m) == 0 and m.weight.data_ptr() == ptr
    assert not lazy_zeros((4, 4), torch.float32).any()


def test_a_kv_cache_larger_than_available_memory_fails_at_start_up():
    from kiln.runner.kv_backing import check_fits_in_memory

    check_fits_in_memory(1 << 20)
    with pytest.raises(ValueError, match="lower kv_cache_memory"):
        check_fits_in_memory(1 << 50)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")
def test_kv_cache_backs_its_first_blocks_at_start_up_and_the_rest_on_use():
    from kiln.kv_cache.kv_cache_spec import FullAttentionSpec
    from kiln.runner.kv_alloc import allocate_kv_cache

    spec = FullAttentionSpec(16, 3, 64, torch.bfloat16)
    buffer, slots, ready = allocate_kv_cache(spec, 2, 4096, torch.device("cpu"))
    ready.join()
    # 2 layers x keys/values, 24 MiB each: the first 2 MiB of each is backed, nothing
    # else, and on 4 KiB pages.
    backed = resident_kib(buffer)
    assert 4 * 2040 <= backed <= 4 * 2056 < buffer.numel() * 2 // 1024
    assert anon_huge_kib(buffer.data_ptr()) == 0
    assert not slots[1][1, 0].any() and not slots[1][1, -1].any()
    slots[1][1, -1].fill_(1.0)  # a block far from the front: one more page, on use
    assert resident_kib(buffer) - backed in (4, 8, 12)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")
def test_the_backfill_backs_the_whole_cache_and_keeps_what_the_engine_wrote():
    from kiln.kv_cache.kv_cache_spec import FullAttentionSpec
    from kiln.runner.kv_alloc import allocate_kv_cache
    from kiln.runner.kv_backing import start_backfill

    spec = FullAttentionSpec(16, 3, 64, torch.bfloat16)
    buffer, slots, ready = allocate_kv_cache(spec, 2, 4096, torch.device("cpu"))
    ready.join()
    assert start_backfill(buffer, "first") is None and start_backfill(buffer, "all") is None
    before = resident_kib(buffer)
    thread = start_backfill(buffer, "")
    # The engine writes blocks while the backfill runs, ahead of it and behind it: the
    # advice backs pages as a write would and must change none of their bytes.
    marks = [(layer, kv, block) for layer in (0, 1) for kv in (0, 1)
             for block in (3, 700, 2100, 4095)]
    for i, (layer, kv, block) in enumerate(marks):
        slots[layer][kv, block].fill_(float(i + 1))
    thread.join(timeout=60)
    assert not thread.is_alive()
    whole = buffer.numel() * buffer.element_size() // 1024
    assert before < whole // 4 and resident_kib(buffer) >= whole - 4
    for i, (layer, kv, block) in enumerate(marks):
        assert slots[layer][kv, block].eq(float(i + 1)).all()
        slots[layer][kv, block].zero_()
    assert not buffer.any()


def test_kiln_kv_prefault_takes_only_its_three_settings(monkeypatch):
    from kiln import envs

    for value in ("", "all", "first", " ALL "):
        monkeypatch.setenv("KILN_KV_PREFAULT", value)
        assert envs.KILN_KV_PREFAULT == value.strip().lower()
    monkeypatch.setenv("KILN_KV_PREFAULT", "eager")
    with pytest.raises(ValueError, match="KILN_KV_PREFAULT='eager'"):
        envs.KILN_KV_PREFAULT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")
def test_an_engine_backs_its_whole_kv_cache_once_it_has_started(tiny_models, monkeypatch):
    """By default (the suite sets `first`: see the Makefile) an engine backs the rest of
    its cache on the backfill thread after start-up, and still answers."""
    import threading

    from kiln import LLM, SamplingParams

    monkeypatch.delenv("KILN_KV_PREFAULT", raising=False)
    llm = LLM(str(tiny_models["llama"][0]), dtype="float32", optimization_level=0,
              progress=False, kv_cache_memory=32 << 20)
    for thread in threading.enumerate():
        if thread.name == "kiln-kv-backfill":
            thread.join(timeout=60)
    buffer = llm.engine.executor.runner._kv_layout.buffer
    whole = buffer.numel() * buffer.element_size() // 1024
    assert resident_kib(buffer) >= whole - 4
    out = llm.generate({"prompt_token_ids": [1, 5, 9, 13]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_loader_moves_weights_unless_kiln_huge_pages_is_0(tiny_models, monkeypatch):
    """The engine's loader moves the weights (the move itself is tested above) unless
    KILN_HUGE_PAGES=0, which the suite sets (see the Makefile)."""
    from kiln.config.quantization import QuantizationConfig
    from kiln.models.model_config import ModelConfig
    from kiln.runner import load

    moved: list[nn.Module] = []
    monkeypatch.setattr(load, "move_weights_to_huge_pages", moved.append)
    config = ModelConfig.from_pretrained(tiny_models["llama"][0])
    for value, calls in (("1", 1), ("0", 1), ("", 2)):
        monkeypatch.setenv("KILN_HUGE_PAGES", value)
        model = load.load_weights(config, QuantizationConfig(), torch.float32,
                                  torch.device("cpu"), progress=False)
        assert len(moved) == calls and (moved[-1] is model) == (value != "0"), value
