/*
 * A native library's constants and limits, exported by name for its Python side:
 * kvgraftd.engine.model.kernel_libraries reads a library's table once, when it loads it, so the
 * C headers are the one source of every value the two sides share and Python repeats none.
 * A table is an array of entries that ends with {NULL, 0}.
 */
#ifndef KVG_CONSTANTS_TABLE_H
#define KVG_CONSTANTS_TABLE_H
#include <stddef.h>
#include <stdint.h>

struct kvg_constant {
    const char *name;
    int64_t value;
};

#endif
