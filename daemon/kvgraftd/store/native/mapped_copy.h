/*
 * One page copied and checked in one pass (included by each build of
 * mapped_pages.c: the portable one there, mapped_copy_avx2.c, mapped_copy_avx512.c,
 * each with its own XXH_VECTOR, KVG_SUFFIX and, for the vector builds, the vector that
 * KVG_STREAM_LOAD and KVG_STREAM_STORE move, KVG_STREAM_BYTES long: stores that bypass the
 * cache).
 *
 * copy_and_check_<suffix>(source, dest, length, expected): copy `length` bytes
 *   piece by piece, then hash each piece (xxh3-128, streaming: the same digest
 *   as the one-shot hash) from the source, whose lines the copy has just
 *   brought into the core's cache: the page is read from memory once. Where
 *   the build streams, the copy's stores go around the cache (a store through
 *   the cache first reads the line it fills: a third more memory traffic).
 *   Hashing the source after copying it can only find a page worse than its
 *   copy (stored bytes change only by damage, never back), never pass a copy
 *   that is bad (a fault of the copy itself, in the CPU or its memory, is not what
 *   the check is for: it guards the bytes on disk). Returns 1 where the digest (canonical, big-endian) differs
 *   from the 16 bytes at `expected`, else 0; with `expected` NULL it only copies.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define KVG_PIECE_BYTES (16u << 10) /* fits the first-level cache beside its source */

#define KVG_CAT2(a, b) a##_##b
#define KVG_CAT(a, b) KVG_CAT2(a, b)

#ifdef KVG_STREAM_BYTES
/* whole vectors: `length` a multiple of KVG_STREAM_BYTES, `dest` aligned to it */
static void kvg_stream_copy(char *dest, const char *source, size_t length) {
    for (size_t at = 0; at < length; at += KVG_STREAM_BYTES)
        KVG_STREAM_STORE((KVG_STREAM_VECTOR *)(dest + at),
                         KVG_STREAM_LOAD((const KVG_STREAM_VECTOR *)(source + at)));
}

/* memcpy with the stores streamed where `dest` is aligned for them */
static void copy_piece(char *dest, const char *source, size_t length) {
    size_t head = (KVG_STREAM_BYTES - (uintptr_t)dest % KVG_STREAM_BYTES) % KVG_STREAM_BYTES;
    if (head >= length) {
        memcpy(dest, source, length);
        return;
    }
    memcpy(dest, source, head);
    size_t body = (length - head) / KVG_STREAM_BYTES * KVG_STREAM_BYTES;
    kvg_stream_copy(dest + head, source + head, body);
    memcpy(dest + head + body, source + head + body, length - head - body);
}
#else
#define copy_piece memcpy
#endif

int KVG_CAT(kvg_copy_and_check, KVG_SUFFIX)(const char *source, char *dest, size_t length,
                                            const uint8_t *expected) {
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    for (size_t done = 0; done < length; done += KVG_PIECE_BYTES) {
        size_t piece = length - done < KVG_PIECE_BYTES ? length - done : KVG_PIECE_BYTES;
        copy_piece(dest + done, source + done, piece);
        if (expected != NULL) XXH3_128bits_update(&state, source + done, piece);
    }
#ifdef KVG_STREAM_BYTES
    _mm_sfence(); /* the streamed stores are visible before the page is called read */
#endif
    if (expected == NULL) return 0;
    XXH128_canonical_t digest;
    XXH128_canonicalFromHash(&digest, XXH3_128bits_digest(&state));
    return memcmp(digest.digest, expected, sizeof digest.digest) != 0;
}
