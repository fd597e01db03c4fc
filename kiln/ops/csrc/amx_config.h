// The 64-byte tile configuration `ldtilecfg` reads (palette 1: tile t has rows[t] rows of
// colsb[t] bytes), shared by the kernels (amx.h), the emulated tiles (amx_emulated.h) and
// their check (tests/amx_tile_check.cpp). No intrinsics: any build may include it.
#pragma once
#include <cstdint>

namespace kiln_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

}  // namespace kiln_amx
