/*
 * SHA-256 of up to 16 messages of one length at once, one message per 32-bit
 * lane of AVX-512 registers (loaded with ctypes by kvgraftd.store.sha256_lanes).
 *
 * A page received from a peer is accepted only once its SHA-256 matches its
 * name, and a message of pages holds dozens of them: hashing 16 side by side
 * makes 2.2-2.7 GB/s on one core of the machine this was written on, against
 * 1.2-1.3 for OpenSSL's one-message SHA-NI code (FIPS 180-4, as a reference
 * implementation would compute it: the tests compare every digest with
 * hashlib's).
 *
 * kvg_sha256_lanes_supported(): 1 where this CPU runs the kernels' AVX-512 build
 *   (engine/native/cpu_features.h: one detection for every native kernel), else 0
 *   (then nothing else here may be called).
 * kvg_sha256_x16(messages, copies, count, len, out): the SHA-256 of
 *   messages[0..count) (1 <= count <= 16), each `len` bytes, to
 *   out[32 * i .. 32 * i + 32). Where `copies` is not NULL, message i is also
 *   copied to copies[i] in the same pass (the bytes hashed are the bytes
 *   written: one read of each). The unused lanes hash messages[0] again; their
 *   digests are dropped and they copy nothing.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_features.h"

#if KVG_X86_BUILDS
#include <immintrin.h>

int kvg_sha256_lanes_supported(void) { return kvg_cpu_has_avx512(); }

KVG_TARGET_AVX512

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* r[i] holds the 16 words of lane i's block; afterwards r[t] holds word t of every lane. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

#define ROR(x, n) _mm512_ror_epi32((x), (n))
#define XOR3(a, b, c) _mm512_ternarylogic_epi32((a), (b), (c), 0x96)
#define ADD(a, b) _mm512_add_epi32((a), (b))

/* One 64-byte block of every lane: lane i's block starts at block[i] + offset (and is
 * copied to copies[i] + offset for i < copied). */
static void compress16(__m512i state[8], const uint8_t *const block[16], size_t offset,
                       uint8_t *const *copies, int copied) {
    const __m512i big_endian =
        _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    __m512i w[16];
    for (int lane = 0; lane < 16; lane++)
        w[lane] = _mm512_loadu_si512((const void *)(block[lane] + offset));
    for (int lane = 0; lane < copied; lane++)
        _mm512_storeu_si512((void *)(copies[lane] + offset), w[lane]);
    transpose16(w);
    for (int t = 0; t < 16; t++) w[t] = _mm512_shuffle_epi8(w[t], big_endian);
    __m512i a = state[0], b = state[1], c = state[2], d = state[3];
    __m512i e = state[4], f = state[5], g = state[6], h = state[7];
    _Pragma("GCC unroll 64") for (int t = 0; t < 64; t++) {
        __m512i wt = w[t & 15];
        if (t >= 16) { /* the message schedule, in a ring of 16 words */
            __m512i w2 = w[(t - 2) & 15], w15 = w[(t - 15) & 15];
            __m512i s1 = XOR3(ROR(w2, 17), ROR(w2, 19), _mm512_srli_epi32(w2, 10));
            __m512i s0 = XOR3(ROR(w15, 7), ROR(w15, 18), _mm512_srli_epi32(w15, 3));
            wt = ADD(ADD(s1, w[(t - 7) & 15]), ADD(s0, wt));
            w[t & 15] = wt;
        }
        __m512i sum1 = XOR3(ROR(e, 6), ROR(e, 11), ROR(e, 25));
        __m512i choice = _mm512_ternarylogic_epi32(e, f, g, 0xCA);
        __m512i t1 = ADD(ADD(h, sum1), ADD(choice, ADD(wt, _mm512_set1_epi32((int)K[t]))));
        __m512i sum0 = XOR3(ROR(a, 2), ROR(a, 13), ROR(a, 22));
        __m512i majority = _mm512_ternarylogic_epi32(a, b, c, 0xE8);
        h = g, g = f, f = e, e = ADD(d, t1);
        d = c, c = b, b = a, a = ADD(t1, ADD(sum0, majority));
    }
    state[0] = ADD(state[0], a), state[1] = ADD(state[1], b);
    state[2] = ADD(state[2], c), state[3] = ADD(state[3], d);
    state[4] = ADD(state[4], e), state[5] = ADD(state[5], f);
    state[6] = ADD(state[6], g), state[7] = ADD(state[7], h);
}

void kvg_sha256_x16(const uint8_t *const *messages, uint8_t *const *copies, int32_t count,
                    size_t len, uint8_t *out) {
    const uint8_t *lane[16];
    for (int i = 0; i < 16; i++) lane[i] = messages[i < count ? i : 0];
    int copied = copies ? count : 0;
    __m512i state[8];
    for (int i = 0; i < 8; i++) state[i] = _mm512_set1_epi32((int)H0[i]);
    size_t whole = len & ~(size_t)63;
    for (size_t offset = 0; offset < whole; offset += 64)
        compress16(state, lane, offset, copies, copied);

    /* The last bytes, the 0x80 terminator and the length in bits: one or two blocks. */
    size_t rest = len - whole, tail_blocks = rest + 9 <= 64 ? 1 : 2;
    uint64_t bits = (uint64_t)len * 8;
    uint8_t tail[16][128];
    const uint8_t *tails[16];
    for (int i = 0; i < 16; i++) {
        memset(tail[i], 0, sizeof tail[i]);
        memcpy(tail[i], lane[i] + whole, rest);
        tail[i][rest] = 0x80;
        for (int k = 0; k < 8; k++) tail[i][tail_blocks * 64 - 1 - k] = (uint8_t)(bits >> (8 * k));
        tails[i] = tail[i];
    }
    for (int i = 0; i < copied; i++) memcpy(copies[i] + whole, tail[i], rest); /* as hashed */
    for (size_t k = 0; k < tail_blocks; k++) compress16(state, tails, 64 * k, NULL, 0);

    uint32_t words[8][16];
    for (int i = 0; i < 8; i++) _mm512_storeu_si512(words[i], state[i]);
    for (int m = 0; m < count; m++)
        for (int i = 0; i < 8; i++) {
            uint32_t v = words[i][m];
            uint8_t *to = out + 32 * m + 4 * i;
            to[0] = (uint8_t)(v >> 24), to[1] = (uint8_t)(v >> 16);
            to[2] = (uint8_t)(v >> 8), to[3] = (uint8_t)v;
        }
}

KVG_TARGET_END

#else /* not x86-64: hashlib does the work */

int kvg_sha256_lanes_supported(void) { return 0; }

void kvg_sha256_x16(const uint8_t *const *messages, uint8_t *const *copies, int32_t count,
                    size_t len, uint8_t *out) {
    (void)messages, (void)copies, (void)count, (void)len, (void)out;
}

#endif
