/*
 * store/store.h - tiers: byte-blob backends outside the pool. Redis through
 * hiredis is the first. The store knows keys and byte strings, nothing of
 * pools, blocks or codecs (pages/offload.c lays the blobs out).
 *
 * A store is opened from a URL:
 *   redis://[host][:port][/db][?opt=value&...]     TCP (default 127.0.0.1:6379, db 0)
 *   unix:///path/to/redis.sock[?db=N&...]          a Unix socket
 * options: prefix=STR (key prefix, default "kvp:"), ttl=S (seconds a blob
 * lives, 0 = forever, the default), max_bytes=N[K|M|G|T] (writes are
 * refused while the server's used_memory plus what they add would pass N;
 * 0 = no cap, the default), timeout_ms=N (connect and each reply, default
 * 5000).
 *
 * Every call returns KVP_OK or a negative status with a message naming the
 * key: KVP_EIO for a connection, timeout or server error (the connection is
 * then dropped and the next call reconnects), KVP_ENOMEM. Calls batch their
 * commands in a pipeline (up to KVP__STORE_WINDOW commands or
 * KVP__STORE_WINDOW_BYTES bytes in flight). One thread at a time per store.
 */
#ifndef KVP_STORE_H
#define KVP_STORE_H

#include "../util/util.h"

#define KVP__STORE_KEY_MAX 160u                  /* bytes of a full key, with its NUL */
#define KVP__STORE_WINDOW 32u                    /* commands in flight */
#define KVP__STORE_WINDOW_BYTES (64ull << 20)    /* value bytes in flight */

/* Was the store compiled in (hiredis present at build time)? */
bool kvp__store_available(void);

/* The key prefix of st ("kvp:" by default). */
const char *kvp__store_prefix(const kvp_store *st);

/* SET keys[i] = vals[i] (lens[i] bytes) for i < n, with the store's TTL.
 * On failure some keys may have been written (the caller deletes them).
 * With max_bytes, each window of SETs is checked first against the
 * server's used_memory (one INFO round trip): KVP_ENOSPC naming the window's
 * first key, none of that window written. */
int kvp__store_put(kvp_store *st, uint32_t n, const char *const *keys, const void *const *vals, const size_t *lens);
/* exists[i] = whether keys[i] is present. */
int kvp__store_exists(kvp_store *st, uint32_t n, const char *const *keys, bool *exists);
/* DEL keys (missing ones are fine). */
int kvp__store_del(kvp_store *st, uint32_t n, const char *const *keys);
/* GET keys[i] for i < n, in order, calling fn(ctx, i, data, len) for each
 * (data NULL when the key is missing; valid only during the call). fn
 * returns KVP_OK to go on, or a status that stops the walk and is returned. */
typedef int (*kvp__store_get_fn)(void *ctx, uint32_t i, const void *data, size_t len);
int kvp__store_get(kvp_store *st, uint32_t n, const char *const *keys, kvp__store_get_fn fn, void *ctx);

/* The CUDA stream device page copies of transfers through st run on
 * (kvp_store_set_stream; NULL: the legacy default stream). The store only
 * keeps it for the pool's side (pages/blob.c). */
void *kvp__store_stream(const kvp_store *st);

/* Bytes sent as values and received as values since open (for stats). */
void kvp__store_traffic(const kvp_store *st, uint64_t *sent_bytes, uint64_t *received_bytes);

#endif /* KVP_STORE_H */
