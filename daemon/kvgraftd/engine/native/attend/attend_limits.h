/*
 * The statuses and limits of the attention kernel (attend_kernel.h): what it returns and
 * which shapes it takes. attend_limits.c exports them to Python as kvg_attend_constants,
 * so kvgraftd.engine.model.decode_attention repeats none.
 */
#ifndef KVG_ATTEND_LIMITS_H
#define KVG_ATTEND_LIMITS_H

#define KVG_MISMATCH 1       /* a checked page's bytes do not hash to its checksum */
#define KVG_BAD_ARGS 2       /* a shape the kernel does not take */
#define KVG_FAULTED 3        /* a checked page's mapping could not be read (a damaged file) */
#define KVG_MAX_ROWS 8       /* query rows per KV head (group size x tokens) */
#define KVG_LANE_FLOATS 16   /* D is a multiple of a vector's floats ... */
#define KVG_MAX_LANES 16     /* ... and at most this many vectors: D <= 256 */
#define KVG_CHECKSUM_BYTES 16 /* a page's checksum: xxh3-128, canonical (big-endian) bytes */
#define KVG_TILE_TOKENS 16   /* a prefill's tokens attending one block together (tile_partial) */

#endif
