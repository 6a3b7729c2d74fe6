/* The attention library's statuses and limits (attend_limits.h) by name, for its Python side
 * (kvgraftd.engine.model.decode_attention reads the table once, when it loads the library). */
#include "attend_limits.h"
#include "constants_table.h"

const struct kvg_constant kvg_attend_constants[] = {
    {"MISMATCH", KVG_MISMATCH},
    {"BAD_ARGS", KVG_BAD_ARGS},
    {"FAULTED", KVG_FAULTED},
    {"MAX_ROWS", KVG_MAX_ROWS},
    {"DIM_MULTIPLE", KVG_LANE_FLOATS},
    {"MAX_DIM", KVG_LANE_FLOATS * KVG_MAX_LANES},
    {"CHECKSUM_BYTES", KVG_CHECKSUM_BYTES},
    {"TILE_TOKENS", KVG_TILE_TOKENS},
    {NULL, 0},
};
