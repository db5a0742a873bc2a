/*
 * store/redis.c - the Redis backend of the store tier, through hiredis.
 *
 * One blocking connection per store, opened at kvp_store_open and again
 * after any failure (a dead connection is dropped at once, so a server that
 * comes back is reached by the next call). Commands go in pipelined
 * windows: append up to KVP__STORE_WINDOW commands or
 * KVP__STORE_WINDOW_BYTES value bytes, then read their replies in order.
 * Every reply is checked for its type before it is used; a failure names
 * the key it concerns. With max_bytes, a window of SETs is preceded by one
 * INFO memory: used_memory + the window's value bytes <= max_bytes, or the
 * window is refused (KVP_ENOSPC) before any of it is sent. Built without hiredis, kvp_store_open returns
 * KVP_ENOTSUP saying so, and nothing else can be reached.
 */
#include "store.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVP_HAVE_HIREDIS
#include <hiredis.h>
#include <sys/time.h>

struct kvp_store {
  char *url;              /* as given (for messages) */
  char host[256];         /* TCP host, or the socket path when unix */
  int port;               /* TCP port (0: unix socket) */
  int db;                 /* database index */
  char prefix[64];        /* key prefix */
  uint64_t ttl_s;         /* seconds a blob lives; 0 = no expiry */
  uint64_t max_bytes;     /* cap on the server's used_memory for our writes; 0 = none */
  uint64_t timeout_ms;    /* connect and per-reply timeout */
  redisContext *c;        /* the connection, or NULL (reconnect on next use) */
  uint64_t sent_bytes;    /* value bytes written (relaxed atomics: kvp_store_traffic reads them from any thread) */
  uint64_t received_bytes; /* value bytes read (likewise) */
  void *stream;           /* cudaStream_t of device page copies (kvp_store_set_stream), or NULL */
};

bool kvp__store_available(void) { return true; }

static void drop(kvp_store *st) {
  if (st->c) redisFree(st->c);
  st->c = NULL;
}

/* A failure of the connection: dropped; KVP_EIO naming what and the key. */
static int io_fail(kvp_store *st, const char *what, const char *key) {
  char why[160];
  snprintf(why, sizeof why, "%s", st->c && st->c->errstr[0] ? st->c->errstr : "connection lost");
  if (st->c && st->c->err == REDIS_ERR_IO && strstr(st->c->errstr, "temporarily unavailable")) snprintf(why, sizeof why, "timed out after %llu ms",
                                                                        (unsigned long long)st->timeout_ms);
  drop(st);
  return kvp__err(KVP_EIO, "store %s: %s of key %s failed: %s", st->url, what, key ? key : "(none)", why);
}

static int connect_now(kvp_store *st) {
  if (st->c) return KVP_OK;
  struct timeval tv = {(time_t)(st->timeout_ms / 1000), (suseconds_t)(st->timeout_ms % 1000) * 1000};
  st->c = st->port ? redisConnectWithTimeout(st->host, st->port, tv) : redisConnectUnixWithTimeout(st->host, tv);
  if (!st->c) return kvp__err(KVP_ENOMEM, "store %s: connection object", st->url);
  if (st->c->err) {
    char why[160];
    snprintf(why, sizeof why, "%s", st->c->errstr);
    drop(st);
    return kvp__err(KVP_EIO, "store %s: cannot connect: %s", st->url, why);
  }
  if (redisSetTimeout(st->c, tv) != REDIS_OK) return io_fail(st, "setting the timeout", NULL);
  if (st->db) {
    redisReply *r = redisCommand(st->c, "SELECT %d", st->db);
    if (!r) return io_fail(st, "SELECT", NULL);
    bool ok = r->type == REDIS_REPLY_STATUS;
    char msg[128];
    snprintf(msg, sizeof msg, "%s", r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
    freeReplyObject(r);
    if (!ok) {
      drop(st);
      return kvp__err(KVP_EIO, "store %s: SELECT %d refused: %s", st->url, st->db, msg);
    }
  }
  return KVP_OK;
}

/* ---- URL ------------------------------------------------------------------- */

static int parse_u64(const char *v, size_t n, uint64_t max, uint64_t *out) {
  if (!n || n > 19) return -1;
  uint64_t x = 0;
  for (size_t i = 0; i < n; i++) {
    if (v[i] < '0' || v[i] > '9') return -1;
    x = x * 10 + (uint64_t)(v[i] - '0');
  }
  if (x > max) return -1;
  *out = x;
  return 0;
}

static int parse_opts(kvp_store *st, const char *q, const char *url) {
  while (q && *q) {
    const char *amp = strchr(q, '&'), *end = amp ? amp : q + strlen(q), *eq = memchr(q, '=', (size_t)(end - q));
    if (!eq) return kvp__err(KVP_EINVAL, "store URL \"%s\": option \"%.*s\" has no '='", url, (int)(end - q), q);
    size_t kn = (size_t)(eq - q), vn = (size_t)(end - eq - 1);
    const char *v = eq + 1;
    uint64_t x = 0;
    if (kn == 6 && !memcmp(q, "prefix", 6)) {
      if (vn >= sizeof st->prefix) return kvp__err(KVP_EINVAL, "store URL \"%s\": prefix longer than %zu bytes", url,
                                                   sizeof st->prefix - 1);
      memcpy(st->prefix, v, vn);
      st->prefix[vn] = 0;
    } else if (kn == 3 && !memcmp(q, "ttl", 3)) {
      if (parse_u64(v, vn, 1ull << 40, &x)) return kvp__err(KVP_EINVAL, "store URL \"%s\": ttl must be seconds", url);
      st->ttl_s = x;
    } else if (kn == 9 && !memcmp(q, "max_bytes", 9)) {
      uint64_t unit = 1;
      char sfx = vn ? (char)(v[vn - 1] | 0x20) : 0;
      if (sfx == 'k' || sfx == 'm' || sfx == 'g' || sfx == 't') {
        unit = 1ull << (sfx == 'k' ? 10 : sfx == 'm' ? 20 : sfx == 'g' ? 30 : 40);
        vn--;
      }
      if (parse_u64(v, vn, (1ull << 50) / unit, &x))
        return kvp__err(KVP_EINVAL, "store URL \"%s\": max_bytes must be bytes, or a number with K, M, G or T "
                        "(powers of 1024), up to 1P", url);
      st->max_bytes = x * unit;
    } else if (kn == 10 && !memcmp(q, "timeout_ms", 10)) {
      if (parse_u64(v, vn, 86400000, &x) || !x)
        return kvp__err(KVP_EINVAL, "store URL \"%s\": timeout_ms must be 1..86400000", url);
      st->timeout_ms = x;
    } else if (kn == 2 && !memcmp(q, "db", 2)) {
      if (parse_u64(v, vn, 1 << 20, &x)) return kvp__err(KVP_EINVAL, "store URL \"%s\": db must be a number", url);
      st->db = (int)x;
    } else {
      return kvp__err(KVP_EINVAL, "store URL \"%s\": unknown option \"%.*s\" (known: prefix, ttl, max_bytes, "
                      "timeout_ms, db)",
                      url, (int)kn, q);
    }
    q = amp ? amp + 1 : NULL;
  }
  return KVP_OK;
}

static int parse_url(kvp_store *st, const char *url) {
  const char *q = strchr(url, '?');
  size_t n = q ? (size_t)(q - url) : strlen(url);
  strcpy(st->prefix, "kvp:");
  st->timeout_ms = 5000;
  if (n > 8 && !memcmp(url, "unix://", 7)) {
    if (n - 7 >= sizeof st->host) return kvp__err(KVP_EINVAL, "store URL \"%s\": socket path too long", url);
    memcpy(st->host, url + 7, n - 7);
    st->host[n - 7] = 0;
    st->port = 0;
  } else if (n >= 8 && !memcmp(url, "redis://", 8)) {
    const char *h = url + 8, *e = url + n, *slash = memchr(h, '/', (size_t)(e - h));
    const char *hend = slash ? slash : e, *colon = memchr(h, ':', (size_t)(hend - h));
    size_t hn = (size_t)((colon ? colon : hend) - h);
    if (hn >= sizeof st->host) return kvp__err(KVP_EINVAL, "store URL \"%s\": host too long", url);
    memcpy(st->host, hn ? h : "127.0.0.1", hn ? hn : 9);
    st->host[hn ? hn : 9] = 0;
    uint64_t x = 6379;
    if (colon && parse_u64(colon + 1, (size_t)(hend - colon - 1), 65535, &x))
      return kvp__err(KVP_EINVAL, "store URL \"%s\": port must be 1..65535", url);
    if (!x) return kvp__err(KVP_EINVAL, "store URL \"%s\": port must be 1..65535", url);
    st->port = (int)x;
    if (slash && slash + 1 < e) {
      if (parse_u64(slash + 1, (size_t)(e - slash - 1), 1 << 20, &x))
        return kvp__err(KVP_EINVAL, "store URL \"%s\": database after '/' must be a number", url);
      st->db = (int)x;
    }
  } else {
    return kvp__err(KVP_EINVAL, "store URL \"%s\": expected redis://host:port/db or unix:///path", url);
  }
  return parse_opts(st, q ? q + 1 : NULL, url);
}

KVP_API int kvp_store_open(const char *url, kvp_store **out) {
  if (!out) return kvp__err(KVP_EINVAL, "store out pointer is NULL");
  *out = NULL;
  if (!url) return kvp__err(KVP_EINVAL, "store URL is NULL");
  kvp_store *st = calloc(1, sizeof *st);
  if (!st || !(st->url = strdup(url))) {
    free(st);
    return kvp__err(KVP_ENOMEM, "store object");
  }
  int rc = parse_url(st, url);
  if (!rc) rc = connect_now(st);
  if (!rc) {
    redisReply *r = redisCommand(st->c, "PING");
    if (!r) rc = io_fail(st, "PING", NULL);
    else if (r->type == REDIS_REPLY_ERROR) rc = kvp__err(KVP_EIO, "store %s: PING refused: %s", url, r->str);
    if (r) freeReplyObject(r);
  }
  if (rc) {
    kvp_store_close(st);
    return rc;
  }
  *out = st;
  return KVP_OK;
}

KVP_API void kvp_store_close(kvp_store *st) {
  if (!st) return;
  drop(st);
  free(st->url);
  free(st);
}

const char *kvp__store_prefix(const kvp_store *st) { return st->prefix; }
void *kvp__store_stream(const kvp_store *st) { return st->stream; }

KVP_API int kvp_store_set_stream(kvp_store *st, void *stream) {
  if (!st) return kvp__err(KVP_EINVAL, "store stream: store is NULL");
  st->stream = stream;
  return KVP_OK;
}

void kvp__store_traffic(const kvp_store *st, uint64_t *sent_bytes, uint64_t *received_bytes) {
  *sent_bytes = __atomic_load_n(&st->sent_bytes, __ATOMIC_RELAXED);
  *received_bytes = __atomic_load_n(&st->received_bytes, __ATOMIC_RELAXED);
}

/* ---- pipelined commands ------------------------------------------------------ */

typedef enum { OP_SET, OP_EXISTS, OP_DEL, OP_GET } op_kind;

typedef struct batch {
  op_kind op;
  uint32_t n;
  const char *const *keys;
  const void *const *vals;
  const size_t *lens;
  bool *exists;
  kvp__store_get_fn fn;
  void *ctx;
} batch;

static int append_one(kvp_store *st, const batch *b, uint32_t i) {
  const char *argv[5];
  size_t argl[5];
  int argc = 0;
  char ttl[24];
  switch (b->op) {
  case OP_SET:
    argv[argc] = "SET", argl[argc++] = 3;
    argv[argc] = b->keys[i], argl[argc++] = strlen(b->keys[i]);
    argv[argc] = b->vals[i], argl[argc++] = b->lens[i];
    if (st->ttl_s) {
      argv[argc] = "EX", argl[argc++] = 2;
      argl[argc] = (size_t)snprintf(ttl, sizeof ttl, "%llu", (unsigned long long)st->ttl_s);
      argv[argc++] = ttl;
    }
    break;
  case OP_EXISTS: argv[argc] = "EXISTS", argl[argc++] = 6; goto key;
  case OP_DEL: argv[argc] = "DEL", argl[argc++] = 3; goto key;
  case OP_GET: argv[argc] = "GET", argl[argc++] = 3;
  key:
    argv[argc] = b->keys[i], argl[argc++] = strlen(b->keys[i]);
    break;
  }
  if (redisAppendCommandArgv(st->c, argc, argv, argl) != REDIS_OK) return io_fail(st, "queueing a command", b->keys[i]);
  return KVP_OK;
}

static const char *op_name(op_kind op) {
  return op == OP_SET ? "SET" : op == OP_EXISTS ? "EXISTS" : op == OP_DEL ? "DEL" : "GET";
}

/* Check reply i; consume it. */
static int take_reply(kvp_store *st, const batch *b, uint32_t i, redisReply *r) {
  const char *key = b->keys[i];
  if (r->type == REDIS_REPLY_ERROR)
    return kvp__err(KVP_EIO, "store %s: %s of key %s refused by the server: %s", st->url, op_name(b->op), key, r->str);
  switch (b->op) {
  case OP_SET:
    if (r->type != REDIS_REPLY_STATUS)
      return kvp__err(KVP_EIO, "store %s: SET of key %s: unexpected reply type %d", st->url, key, r->type);
    __atomic_fetch_add(&st->sent_bytes, b->lens[i], __ATOMIC_RELAXED);
    return KVP_OK;
  case OP_EXISTS:
  case OP_DEL:
    if (r->type != REDIS_REPLY_INTEGER)
      return kvp__err(KVP_EIO, "store %s: %s of key %s: unexpected reply type %d", st->url, op_name(b->op), key, r->type);
    if (b->exists) b->exists[i] = r->integer > 0;
    return KVP_OK;
  case OP_GET:
    if (r->type == REDIS_REPLY_NIL) return b->fn(b->ctx, i, NULL, 0);
    if (r->type != REDIS_REPLY_STRING)
      return kvp__err(KVP_EIO, "store %s: GET of key %s: unexpected reply type %d", st->url, key, r->type);
    __atomic_fetch_add(&st->received_bytes, (uint64_t)r->len, __ATOMIC_RELAXED);
    return b->fn(b->ctx, i, r->str, (size_t)r->len);
  }
  return KVP_OK;
}

/* A server that dies mid-write raises SIGPIPE on the write: blocked for the
 * batch in this thread and consumed if it came, so the caller gets KVP_EIO
 * instead of a dead process. */
typedef struct pipe_guard {
  sigset_t old;   /* the thread's mask before */
  bool pending;   /* SIGPIPE was pending before (not ours to consume) */
} pipe_guard;

static void pipe_block(pipe_guard *g) {
  sigset_t set, pend;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  sigpending(&pend);
  g->pending = sigismember(&pend, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, &g->old);
}

static void pipe_restore(pipe_guard *g) {
  sigset_t set, pend;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  sigpending(&pend);
  if (!g->pending && sigismember(&pend, SIGPIPE)) {
    struct timespec zero = {0, 0};
    sigtimedwait(&set, NULL, &zero);
  }
  pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

static int run_batch_(kvp_store *st, const batch *b);

/* The server's used_memory (INFO memory), in bytes. */
static int used_memory(kvp_store *st, const char *key, uint64_t *out) {
  redisReply *r = redisCommand(st->c, "INFO memory");
  if (!r) return io_fail(st, "INFO memory (for max_bytes) before the SET", key);
  const char *f = r->type == REDIS_REPLY_STRING ? strstr(r->str, "used_memory:") : NULL;
  int rc = KVP_OK;
  if (!f) rc = kvp__err(KVP_EIO, "store %s: INFO memory (for max_bytes) before the SET of key %s: no used_memory in "
                        "the reply%s%s", st->url, key, r->type == REDIS_REPLY_ERROR ? ": " : "",
                        r->type == REDIS_REPLY_ERROR ? r->str : "");
  else *out = strtoull(f + 12, NULL, 10);
  freeReplyObject(r);
  return rc;
}

/* A window of SETs of bytes (first key: key) would take the server past
 * max_bytes: KVP_ENOSPC, nothing of it written. */
static int check_room(kvp_store *st, const char *key, uint64_t bytes) {
  uint64_t used = 0;
  int rc = used_memory(st, key, &used);
  if (rc) return rc;
  if (used <= st->max_bytes && bytes <= st->max_bytes - used) return KVP_OK;
  return kvp__err(KVP_ENOSPC, "store %s: SET of key %s refused: the server uses %llu bytes, and %llu more would pass "
                  "max_bytes=%llu", st->url, key, (unsigned long long)used, (unsigned long long)bytes,
                  (unsigned long long)st->max_bytes);
}

static int run_batch(kvp_store *st, const batch *b) {
  pipe_guard g;
  pipe_block(&g);
  int rc = run_batch_(st, b);
  pipe_restore(&g);
  return rc;
}

static int run_batch_(kvp_store *st, const batch *b) {
  int rc = connect_now(st);
  if (rc && b->n) {
    char msg[400];
    snprintf(msg, sizeof msg, "%s", kvp__err_detail());
    return kvp__err(rc, "%s (%s of key %s)", msg, op_name(b->op), b->keys[0]);
  }
  for (uint32_t done = 0; !rc && done < b->n;) {
    uint32_t end = done;
    uint64_t bytes = 0;
    while (end < b->n && end - done < KVP__STORE_WINDOW && (end == done || bytes < KVP__STORE_WINDOW_BYTES)) {
      bytes += b->op == OP_SET ? b->lens[end] : 0;
      end++;
    }
    if (b->op == OP_SET && st->max_bytes && (rc = check_room(st, b->keys[done], bytes))) return rc;
    for (uint32_t i = done; i < end; i++)
      if ((rc = append_one(st, b, i))) return rc;
    /* read every reply of the window, even after a refusal, so the
     * connection stays in step; the first failure is returned */
    int first = KVP_OK;
    for (uint32_t i = done; i < end; i++) {
      redisReply *r = NULL;
      if (redisGetReply(st->c, (void **)&r) != REDIS_OK || !r) {
        if (r) freeReplyObject(r);
        return io_fail(st, op_name(b->op), b->keys[i]);
      }
      int trc = first ? KVP_OK : take_reply(st, b, i, r);
      freeReplyObject(r);
      if (trc && !first) first = trc;
    }
    if (first) return first;
    done = end;
  }
  return rc;
}

int kvp__store_put(kvp_store *st, uint32_t n, const char *const *keys, const void *const *vals, const size_t *lens) {
  return run_batch(st, &(batch){.op = OP_SET, .n = n, .keys = keys, .vals = vals, .lens = lens});
}
int kvp__store_exists(kvp_store *st, uint32_t n, const char *const *keys, bool *exists) {
  return run_batch(st, &(batch){.op = OP_EXISTS, .n = n, .keys = keys, .exists = exists});
}
int kvp__store_del(kvp_store *st, uint32_t n, const char *const *keys) {
  return run_batch(st, &(batch){.op = OP_DEL, .n = n, .keys = keys});
}
int kvp__store_get(kvp_store *st, uint32_t n, const char *const *keys, kvp__store_get_fn fn, void *ctx) {
  return run_batch(st, &(batch){.op = OP_GET, .n = n, .keys = keys, .fn = fn, .ctx = ctx});
}

#else /* no hiredis: the tier is refused by name */

struct kvp_store {
  int unused;
};

bool kvp__store_available(void) { return false; }

KVP_API int kvp_store_open(const char *url, kvp_store **out) {
  if (out) *out = NULL;
  return kvp__err(KVP_ENOTSUP, "store \"%s\": this kvpool was built without hiredis (install libhiredis-dev, "
                               "e.g. with `make deps`, and rebuild)", url ? url : "(null)");
}
KVP_API void kvp_store_close(kvp_store *st) { (void)st; }
const char *kvp__store_prefix(const kvp_store *st) { return ""; }
void *kvp__store_stream(const kvp_store *st) { return NULL; }
KVP_API int kvp_store_set_stream(kvp_store *st, void *stream) {
  (void)stream;
  return kvp__err(st ? KVP_ENOTSUP : KVP_EINVAL, "store stream: %s", st ? "built without hiredis" : "store is NULL");
}
void kvp__store_traffic(const kvp_store *st, uint64_t *s, uint64_t *r) { *s = *r = 0; }
int kvp__store_put(kvp_store *st, uint32_t n, const char *const *k, const void *const *v, const size_t *l) {
  return kvp__err(KVP_ENOTSUP, "store: built without hiredis");
}
int kvp__store_exists(kvp_store *st, uint32_t n, const char *const *k, bool *e) {
  return kvp__err(KVP_ENOTSUP, "store: built without hiredis");
}
int kvp__store_del(kvp_store *st, uint32_t n, const char *const *k) {
  return kvp__err(KVP_ENOTSUP, "store: built without hiredis");
}
int kvp__store_get(kvp_store *st, uint32_t n, const char *const *k, kvp__store_get_fn fn, void *ctx) {
  return kvp__err(KVP_ENOTSUP, "store: built without hiredis");
}
#endif
