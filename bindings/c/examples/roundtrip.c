/* Gathers a KV region of an engine-owned FasterTransformer cache, flushes it to a file, fetches it
 * back into a second cache and checks every byte; then shows the error reporting.
 * Usage: roundtrip DIR (a writable directory for the chunk files). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dejavu.h"

#define CHECK(call)                                                                      \
    do {                                                                                 \
        DjvStatus status_ = (call);                                                      \
        if (status_ != DJV_STATUS_OK) {                                                  \
            fprintf(stderr, "%s failed (%d): %s\n", #call, (int)status_, djv_last_error()); \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    /* A small worker: 4 layers, 2 KV heads of 64 fp16 values, 2 sequences of up to 32 tokens. */
    DjvLayout *layout = NULL;
    CHECK(djv_layout_faster_transformer(4, 2, 64, DJV_ELEMENT_F16, 2, 32, &layout));

    /* The engine owns its KV buffers; the library works on them in place. */
    size_t count = djv_layout_buffer_count(layout);
    uint8_t *buffers[8];
    size_t lens[8];
    for (size_t i = 0; i < count; i++) {
        lens[i] = (size_t)djv_layout_buffer_size(layout, i);
        buffers[i] = malloc(lens[i]);
        for (size_t b = 0; b < lens[i]; b++) buffers[i][b] = (uint8_t)(b * 31 + i * 7 + 3);
    }
    DjvCache *engine = NULL;
    CHECK(djv_cache_wrap(layout, buffers, lens, count, &engine));

    /* Tokens 5..21 of both sequences, every layer and head: many small pieces, one staging buffer. */
    DjvRegion region = {0, 4, 0, 2, 0, 2, 5, 21};
    uint64_t len = 0;
    CHECK(djv_packed_len(engine, &region, &len));
    uint8_t *staged = malloc(len);
    CHECK(djv_gather(engine, &region, staged, len));

    DjvStore *store = NULL;
    CHECK(djv_file_store_open(argv[1], &store));
    DjvWorker source = {0, 0}, destination = {1, 0};
    CHECK(djv_flush(store, engine, &region, source, destination, 3));

    /* Fetch into a second cache of library memory and compare. */
    DjvCache *replica = NULL;
    CHECK(djv_cache_new(layout, &replica));
    CHECK(djv_fetch(store, replica, &region, source, destination, 3));
    uint8_t *back = malloc(len);
    CHECK(djv_gather(replica, &region, back, len));
    if (memcmp(staged, back, len) != 0) {
        fprintf(stderr, "fetched bytes differ\n");
        return 1;
    }

    /* Errors come back as status codes with a message, never as a crash. */
    DjvStatus missing = djv_fetch(store, replica, &region, source, destination, 9);
    if (missing != DJV_STATUS_NOT_FOUND || strlen(djv_last_error()) == 0) {
        fprintf(stderr, "expected NOT_FOUND with a message, got %d\n", (int)missing);
        return 1;
    }
    DjvRegion outside = {0, 4, 0, 2, 0, 2, 30, 40};
    if (djv_gather(engine, &outside, staged, len) != DJV_STATUS_LAYOUT) {
        fprintf(stderr, "expected LAYOUT for a region past the cache\n");
        return 1;
    }
    if (djv_gather(NULL, &region, staged, len) != DJV_STATUS_INVALID_ARGUMENT) {
        fprintf(stderr, "expected INVALID_ARGUMENT for a NULL cache\n");
        return 1;
    }
    printf("round trip of %llu bytes through %s: every byte in place\n", (unsigned long long)len, argv[1]);

    djv_store_free(store);
    djv_cache_free(replica);
    djv_cache_free(engine);
    djv_layout_free(layout);
    for (size_t i = 0; i < count; i++) free(buffers[i]);
    free(staged);
    free(back);
    return 0;
}
