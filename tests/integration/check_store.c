/*
 * tests/integration/check_store.c - prefix sharing and the store tier
 * through the public header, against a real redis-server started on a free
 * loopback port (skipped, with a message, where it or hiredis is missing).
 *
 * Offload and restore round trips (every read equal bit for bit, the ledger
 * back to its figures); each failure (missing, corrupt, truncated blob,
 * another version, geometry or codec; server stopped, frozen, or killed in
 * the middle of an offload) returns its status naming the key and leaves
 * the pool as it was, kvp_check clean; prefix sharing inside a pool
 * (shared once in the ledger, evictions by one sequence leave the others
 * theirs); and two processes sharing a prefix through the store.
 */
#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../../tools/redis_srv.h"
#include "itest.h"
#include "kvgen.h"
#include "kvpool.h"

#ifdef KVP_HAVE_HIREDIS
#include <hiredis.h>
#endif

#define ck_msg(part) ck_assert_msg(strstr(kvp_last_error(), part) != NULL, "message lacks \"%s\": %s", part, kvp_last_error())

enum { L = 3, H = 2, D = 16, BT = 8, MAXT = 512 };

static kvgen G;
static uint16_t K[MAXT * H * D], V[MAXT * H * D];
static redis_srv R;
static int have_server;

static void setup(void) {
  kvgen_init(&G);
  have_server = 0;
#ifdef KVP_HAVE_HIREDIS
  if (redis_srv_start(&R) == 0) have_server = 1;
  else printf("skip: %s\n", R.why);
#else
  printf("skip: built without hiredis (make deps, then rebuild)\n");
#endif
}
static void teardown(void) {
  if (have_server) redis_srv_stop(&R);
}
#define NEED_SERVER()                                                                                                \
  do {                                                                                                               \
    if (!have_server) return;                                                                                        \
  } while (0)

static kvp_pool *mkpool(const char *codecs, uint32_t head_dim) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = head_dim;
  c.region_bytes = 32ull << 20;
  c.block_tokens = BT;
  c.codecs = codecs;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

static kvp_store *mkstore(const char *opts) {
  char url[160];
  snprintf(url, sizeof url, "%s%s", R.url, opts ? opts : "");
  kvp_store *st;
  ck_ok(kvp_store_open(url, &st));
  return st;
}

static void step(kvp_pool *p, uint64_t seq, uint64_t gen_seq, uint32_t pos0, uint32_t n) {
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, gen_seq, l, pos0, n, H, D, K, V);
    kvp_kv kv = {K, V, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
  }
  ck_ok(kvp_step_end(p, seq));
  ck_ok(kvp_check(p));
}

/* Every retained token of seq, every layer and head, as f32, with positions. */
typedef struct snap {
  uint32_t n[L][H];
  float k[L][H][MAXT * D], v[L][H][MAXT * D];
  uint32_t pos[L][H][MAXT];
} snap;

static void take(kvp_pool *p, uint64_t seq, snap *s) {
  memset(s, 0, sizeof *s);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {.struct_size = sizeof q, .head = h, .out_dtype = KVP_DTYPE_F32, .k_out = s->k[l][h],
                        .v_out = s->v[l][h], .positions_out = s->pos[l][h], .capacity_tokens = MAXT};
      ck_ok(kvp_read(p, seq, l, &q));
      s->n[l][h] = q.n_tokens;
    }
}

static snap S1, S2;

typedef struct fp {
  uint64_t req, alloc, pages, tokens, seqs, chunks;
} fp;

static fp fingerprint(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return (fp){s.bytes_requested.current, s.bytes_allocated.current, s.pages.current, s.tokens_retained.current,
              s.sequences.current, s.prefix_chunks.current};
}
static void same_fp(fp a, fp b) {
  ck_assert_uint_eq(a.req, b.req);
  ck_assert_uint_eq(a.alloc, b.alloc);
  ck_assert_uint_eq(a.pages, b.pages);
  ck_assert_uint_eq(a.tokens, b.tokens);
  ck_assert_uint_eq(a.seqs, b.seqs);
  ck_assert_uint_eq(a.chunks, b.chunks);
}

static const char *const specs[] = {NULL, "kv=int8", "kv=nvfp4", "k=fp8,v=int8"};

/* A sequence of three steps (the last leaves an OPEN block) plus a second
 * sequence, offloaded and restored; then it grows again. */
START_TEST(offload_restore_roundtrip) {
  NEED_SERVER();
  kvp_pool *p = mkpool(specs[_i], D);
  kvp_store *st = mkstore("?prefix=t1:&ttl=600");
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_seq_add(p, 2, NULL));
  step(p, 1, 1, 0, 37);
  step(p, 1, 1, 37, 1);
  step(p, 1, 1, 38, 20);
  step(p, 2, 2, 0, 9);
  ck_ok(kvp_evict(p, 1, 1, 0, 1)); /* a hole in one head */
  take(p, 1, &S1);
  fp before = fingerprint(p);
  ck_ok(kvp_seq_offload(p, 1, st));
  ck_ok(kvp_check(p));
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_status(kvp_seq_info(p, 1, &d), KVP_ENOENT);
  fp gone = fingerprint(p);
  ck_assert_uint_lt(gone.alloc, before.alloc);
  ck_assert_uint_eq(gone.seqs, 1);
  ck_status(kvp_seq_restore(p, 2, st), KVP_EEXIST);
  ck_ok(kvp_seq_restore(p, 1, st));
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  take(p, 1, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  /* the store's copy is gone: a second restore finds nothing */
  ck_ok(kvp_seq_free(p, 2));
  ck_status(kvp_seq_restore(p, 1, st), KVP_EEXIST);
  ck_ok(kvp_seq_offload(p, 1, st));
  ck_ok(kvp_seq_restore(p, 1, st));
  step(p, 1, 1, 58, 11); /* it goes on growing */
  ck_ok(kvp_check(p));
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_gt(s.store_offload_bytes, 0);
  ck_assert_uint_gt(s.store_restore_bytes, 0);
  kvp_store_close(st);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(bad_urls) {
  kvp_store *st = (kvp_store *)1;
  ck_status(kvp_store_open("http://x", &st), KVP_EINVAL);
  ck_assert_ptr_null(st);
  ck_msg("http://x");
  ck_status(kvp_store_open("redis://127.0.0.1:99999", &st), KVP_EINVAL);
  ck_msg("port");
  ck_status(kvp_store_open("redis://127.0.0.1:1/0?colour=red", &st), KVP_EINVAL);
  ck_msg("colour");
#ifdef KVP_HAVE_HIREDIS
  int port = redis_srv_free_port(); /* nobody listens there */
  char url[64];
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
  ck_status(kvp_store_open(url, &st), KVP_EIO);
  ck_msg("cannot connect");
  ck_status(kvp_store_open("redis://127.0.0.1:1/0?max_bytes=12X", &st), KVP_EINVAL);
  ck_msg("max_bytes");
  ck_status(kvp_store_open("redis://127.0.0.1:1/0?max_bytes=", &st), KVP_EINVAL);
  ck_msg("max_bytes");
  ck_status(kvp_store_open("redis://127.0.0.1:1/0?max_bytes=2048T", &st), KVP_EINVAL);
  ck_msg("max_bytes");
#else
  ck_status(kvp_store_open("redis://127.0.0.1:6379", &st), KVP_ENOTSUP);
  ck_msg("hiredis");
#endif
}
END_TEST


#ifdef KVP_HAVE_HIREDIS
/* The test's own connection to the server, to damage blobs. */
static redisContext *raw_conn(void) {
  redisContext *c = redisConnect("127.0.0.1", R.port);
  ck_assert(c && !c->err);
  return c;
}

/* The first key matching pattern (keys are few in these tests). */
static void first_key(redisContext *c, const char *pattern, char *out, size_t cap) {
  redisReply *r = redisCommand(c, "KEYS %s", pattern);
  ck_assert(r && r->type == REDIS_REPLY_ARRAY && r->elements > 0);
  snprintf(out, cap, "%s", r->element[0]->str);
  freeReplyObject(r);
}

static void get_val(redisContext *c, const char *key, char **val, size_t *len) {
  redisReply *r = redisCommand(c, "GET %s", key);
  ck_assert(r && r->type == REDIS_REPLY_STRING);
  *val = malloc(r->len);
  memcpy(*val, r->str, r->len);
  *len = r->len;
  freeReplyObject(r);
}
static void set_val(redisContext *c, const char *key, const char *val, size_t len) {
  redisReply *r = redisCommand(c, "SET %s %b", key, val, len);
  ck_assert(r && r->type == REDIS_REPLY_STATUS);
  freeReplyObject(r);
}

/* A damaged blob: the restore fails naming the key, the pool is unchanged,
 * and once the blob is put back it succeeds. */
static void damaged(kvp_pool *p, kvp_store *st, redisContext *c, const char *key, const char *bad, size_t bad_len,
                    const char *orig, size_t orig_len, int want, const char *msg) {
  fp before = fingerprint(p);
  set_val(c, key, bad, bad_len);
  ck_status(kvp_seq_restore(p, 1, st), want);
  ck_msg(key);
  ck_msg(msg);
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  set_val(c, key, orig, orig_len);
}

START_TEST(restore_refuses_bad_blobs) {
  NEED_SERVER();
  kvp_pool *p = mkpool("kv=int8", D);
  kvp_store *st = mkstore(NULL);
  redisContext *c = raw_conn();
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_seq_add(p, 2, NULL));
  step(p, 1, 1, 0, 40);
  step(p, 2, 2, 0, 5);
  take(p, 1, &S1);
  fp full = fingerprint(p);
  ck_status(kvp_seq_restore(p, 7, st), KVP_ENOENT);
  ck_msg("kvp:seq:7");
  ck_ok(kvp_seq_offload(p, 1, st));
  char part[200], man[64] = "kvp:seq:1";
  first_key(c, "kvp:seq:1:*", part, sizeof part);
  char *val, *mval;
  size_t len, mlen;
  get_val(c, part, &val, &len);
  get_val(c, man, &mval, &mlen);
  char *bad = malloc(len > mlen ? len : mlen);
  /* corrupt one payload byte: the checksum */
  memcpy(bad, val, len);
  bad[len - 3] ^= 0x40;
  damaged(p, st, c, part, bad, len, val, len, KVP_EFORMAT, "checksum");
  /* truncated */
  damaged(p, st, c, part, val, len - 100, val, len, KVP_EFORMAT, "truncated");
  damaged(p, st, c, part, val, 10, val, len, KVP_EFORMAT, "truncated");
  /* another format version (offset 4 of the header) */
  memcpy(bad, val, len);
  bad[4] = 9;
  damaged(p, st, c, part, bad, len, val, len, KVP_EFORMAT, "version 9");
  /* a manifest whose checksum fails, and one cut short */
  memcpy(bad, mval, mlen);
  bad[mlen - 1] ^= 1;
  damaged(p, st, c, man, bad, mlen, mval, mlen, KVP_EFORMAT, "checksum");
  damaged(p, st, c, man, mval, mlen / 2, mval, mlen, KVP_EFORMAT, "truncated");
  /* a part that vanished */
  fp before = fingerprint(p);
  redisReply *r = redisCommand(c, "DEL %s", part);
  freeReplyObject(r);
  ck_status(kvp_seq_restore(p, 1, st), KVP_ENOENT);
  ck_msg(part);
  same_fp(fingerprint(p), before);
  ck_ok(kvp_check(p));
  set_val(c, part, val, len);
  /* another geometry and another codec spec refuse the same blobs */
  kvp_pool *other = mkpool("kv=int8", 32);
  ck_status(kvp_seq_restore(other, 1, st), KVP_EFORMAT);
  ck_msg("geometry");
  ck_msg(man);
  ck_ok(kvp_check(other));
  kvp_pool_destroy(other);
  other = mkpool("kv=fp8", D);
  ck_status(kvp_seq_restore(other, 1, st), KVP_EFORMAT);
  ck_msg("codecs");
  kvp_pool_destroy(other);
  /* intact again: it comes back whole */
  ck_ok(kvp_seq_restore(p, 1, st));
  same_fp(fingerprint(p), full);
  take(p, 1, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  free(bad);
  free(val);
  free(mval);
  redisFree(c);
  kvp_store_close(st);
  kvp_pool_destroy(p);
}
END_TEST

/* Server stopped, then frozen (a timeout): each call fails naming the key;
 * nothing is freed or added; the server back, the same calls succeed. */
START_TEST(server_down_and_timeout) {
  NEED_SERVER();
  kvp_pool *p = mkpool(NULL, D);
  kvp_store *st = mkstore("?timeout_ms=300");
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_seq_add(p, 2, NULL));
  step(p, 1, 1, 0, 30);
  step(p, 2, 2, 0, 30);
  take(p, 1, &S1);
  ck_ok(kvp_seq_offload(p, 2, st));
  fp before = fingerprint(p);
  redis_srv_kill(&R, SIGKILL);
  ck_status(kvp_seq_offload(p, 1, st), KVP_EIO);
  ck_msg("kvp:");
  ck_status(kvp_seq_restore(p, 2, st), KVP_EIO);
  ck_msg("kvp:seq:2");
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  take(p, 1, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  /* back (empty: no persistence): offload works again, seq 2 is lost */
  ck_assert_int_eq(redis_srv_launch(&R), 0);
  ck_status(kvp_seq_restore(p, 2, st), KVP_ENOENT);
  /* frozen: timeouts */
  kill(R.pid, SIGSTOP);
  ck_status(kvp_seq_offload(p, 1, st), KVP_EIO);
  ck_msg("timed out");
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  kill(R.pid, SIGCONT);
  ck_ok(kvp_seq_offload(p, 1, st));
  ck_ok(kvp_seq_restore(p, 1, st));
  take(p, 1, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  ck_ok(kvp_check(p));
  kvp_store_close(st);
  kvp_pool_destroy(p);
}
END_TEST

/* Kills the server once the offload under way has had a SET acknowledged
 * (the store's traffic counter moved), so the kill lands between blobs
 * whatever the host's speed; gives up when the offload returned first. */
typedef struct killer {
  redis_srv *r;
  kvp_store *st;
  int done;   /* set (atomically) by the offloading thread when it returned */
  int killed; /* the kill was sent */
} killer;

static void *kill_midway(void *arg) {
  killer *k = arg;
  for (;;) {
    uint64_t sent = 0, recv = 0;
    kvp_store_traffic(k->st, &sent, &recv);
    if (sent) {
      kill(k->r->pid, SIGKILL);
      k->killed = 1;
      return NULL;
    }
    if (__atomic_load_n(&k->done, __ATOMIC_ACQUIRE)) return NULL;
    usleep(20);
  }
}

/* The server is killed while a large offload is in flight. */
START_TEST(server_killed_mid_offload) {
  NEED_SERVER();
  enum { BL = 8, BH = 8, BD = 128, BTOK = 2048 };
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = BL;
  c.n_kv_heads = BH;
  c.head_dim = BD;
  c.region_bytes = 256ull << 20;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  uint16_t *k = calloc((size_t)BTOK * BH * BD, 2), *v = calloc((size_t)BTOK * BH * BD, 2);
  for (size_t i = 0; i < (size_t)BTOK * BH * BD; i++) k[i] = kvgen_bf16((float)(i % 200) - 100), v[i] = k[i] ^ 0x8000;
#define FILL()                                                                                                       \
  do {                                                                                                               \
    ck_ok(kvp_seq_add(p, 1, NULL));                                                                                  \
    ck_ok(kvp_step_begin(p, 1, BTOK, 0));                                                                            \
    for (uint32_t l = 0; l < BL; l++) ck_ok(kvp_append(p, 1, l, &(kvp_kv){k, v, NULL}));                             \
    ck_ok(kvp_step_end(p, 1));                                                                                       \
  } while (0)
  FILL();
  fp before = fingerprint(p);
  int failed_midway = 0;
  /* a few tries: on a fast host the whole offload may be acknowledged
   * between two looks at the counter */
  for (int attempt = 0; attempt < 8 && !failed_midway; attempt++) {
    kvp_store *st = mkstore("?timeout_ms=2000");
    killer kl = {&R, st, 0, 0};
    pthread_t t;
    pthread_create(&t, NULL, kill_midway, &kl);
    int rc = kvp_seq_offload(p, 1, st);
    __atomic_store_n(&kl.done, 1, __ATOMIC_RELEASE);
    pthread_join(t, NULL);
    if (!kl.killed) kill(R.pid, SIGKILL);
    waitpid(R.pid, NULL, 0);
    R.pid = 0;
    if (rc) {
      ck_assert_int_eq(rc, KVP_EIO);
      ck_msg("kvp:seq:1");
      ck_msg("stays in the pool");
      ck_ok(kvp_check(p));
      same_fp(fingerprint(p), before);
      failed_midway = kl.killed;
    } else { /* finished before the kill (the copy died with the server): computed again */
      FILL();
    }
    kvp_store_close(st);
    ck_assert_int_eq(redis_srv_launch(&R), 0);
  }
  ck_assert_msg(failed_midway, "no kill landed in the middle of the offload");
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_ok(kvp_seq_info(p, 1, &d));
  ck_assert_uint_eq(d.n_positions, BTOK);
  /* the sequence still offloads and restores whole */
  kvp_store *st = mkstore(NULL);
  ck_ok(kvp_seq_offload(p, 1, st));
  ck_ok(kvp_seq_restore(p, 1, st));
  same_fp(fingerprint(p), before);
  ck_ok(kvp_check(p));
  kvp_store_close(st);
  free(k);
  free(v);
  kvp_pool_destroy(p);
}
END_TEST
#endif

/* ---- prefix sharing ------------------------------------------------------------ */

static uint32_t TOK[MAXT];

static kvp_seq_config with_tokens(uint32_t n) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.tokens = TOK;
  sc.n_tokens = n;
  return sc;
}

static uint32_t positions(kvp_pool *p, uint64_t seq) {
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_ok(kvp_seq_info(p, seq, &d));
  return d.n_positions;
}

START_TEST(prefix_sharing_in_pool) {
  kvp_pool *p = mkpool(specs[_i], D);
  for (uint32_t i = 0; i < MAXT; i++) TOK[i] = i * 7 + 3;
  kvp_seq_config sc = with_tokens(45);
  ck_ok(kvp_seq_add(p, 1, &sc));
  ck_assert_uint_eq(positions(p, 1), 0);
  step(p, 1, 100, 0, 30); /* chunked prefill: 3 chunks complete */
  step(p, 1, 100, 30, 15); /* 5 chunks */
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.prefix_chunks.current, 5);
  /* same first 33 tokens, then different: 4 chunks attach */
  TOK[33] = 999999;
  sc = with_tokens(60);
  fp before = fingerprint(p);
  ck_ok(kvp_seq_add(p, 2, &sc));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(positions(p, 2), 32);
  fp after = fingerprint(p);
  ck_assert_uint_eq(after.alloc, before.alloc); /* shared: counted once */
  ck_assert_uint_eq(after.tokens, before.tokens + 32ull * L * H);
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.prefix_hit_tokens, 32);
  ck_assert_uint_eq(s.prefix_query_tokens, 105);
  /* seq 2 reads seq 1's values below 32 */
  step(p, 2, 200, 32, 28);
  take(p, 1, &S1);
  take(p, 2, &S2);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      ck_assert_mem_eq(S1.k[l][h], S2.k[l][h], 32 * D * sizeof(float));
      ck_assert_mem_eq(S1.v[l][h], S2.v[l][h], 32 * D * sizeof(float));
    }
  /* an eviction by seq 1 over the shared blocks leaves seq 2 its own */
  ck_ok(kvp_evict(p, 1, 0, 0, 0));
  ck_ok(kvp_check(p));
  take(p, 2, &S1);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  /* a full hit leaves one token to compute; the whole prompt identical */
  TOK[33] = 33 * 7 + 3;
  sc = with_tokens(40);
  ck_ok(kvp_seq_add(p, 3, &sc));
  ck_assert_uint_eq(positions(p, 3), 32); /* chunk 0 is gone from seq 1's layer 0 head 0, but seq 2 holds it */
  /* freeing seq 1 keeps what seq 2 and 3 hold */
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_check(p));
  take(p, 2, &S1);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.prefix_chunks.current, 7); /* 4 shared, and seq 2's own 3 (its prompt goes on differently) */
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_seq_free(p, 3));
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.prefix_chunks.current, 0);
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  /* bad input */
  sc.tokens = NULL;
  ck_status(kvp_seq_add(p, 4, &sc), KVP_EINVAL);
  ck_msg("tokens");
  kvp_pool_destroy(p);
}
END_TEST

static uint64_t meta_bytes(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return s.metadata_bytes.current;
}

static uint64_t chunks_now(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return s.prefix_chunks.current;
}

/* Every (layer, head) of b reads as a's first n positions; ok: heads whose
 * first n are not all there (evicted) are skipped. */
static void same_prefix(const snap *a, const snap *b, uint32_t n, uint32_t skip_l, uint32_t skip_h) {
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      if (l == skip_l && h == skip_h) continue;
      ck_assert_uint_ge(a->n[l][h], n);
      ck_assert_uint_ge(b->n[l][h], n);
      ck_assert_mem_eq(a->pos[l][h], b->pos[l][h], n * sizeof(uint32_t));
      ck_assert_mem_eq(a->k[l][h], b->k[l][h], (size_t)n * D * sizeof(float));
      ck_assert_mem_eq(a->v[l][h], b->v[l][h], (size_t)n * D * sizeof(float));
    }
}

/* The chunk-level reference: an attach takes one reference per chunk (its
 * metadata does not grow with the chunks attached), readers and views see
 * the shared blocks, a fork of the attached sequence shares them too, an
 * eviction by any one sharer (the one that computed them, an attached one,
 * the fork) and frees in every order leave the others theirs, and the last
 * owner's eviction gives the pages back; kvp_check after every step. */
START_TEST(prefix_chunk_references) {
  kvp_pool *p = mkpool(specs[_i], D);
  for (uint32_t i = 0; i < MAXT; i++) TOK[i] = i * 13 + 5;
  kvp_seq_config sc = with_tokens(45);
  ck_ok(kvp_seq_add(p, 1, &sc));
  step(p, 1, 100, 0, 30);
  step(p, 1, 100, 30, 15); /* chunks 0..4 registered by seq 1 */
  ck_assert_uint_eq(chunks_now(p), 5);
  ck_ok(kvp_reclaim(p)); /* the OPEN blocks' raw pages, replaced at their seal */
  uint64_t alloc0 = fingerprint(p).alloc;
  /* metadata of an attach: 1 chunk vs 5 (same prompt length, so the same key and hold arrays) */
  uint32_t keep = TOK[9];
  TOK[9] = 4242; /* diverges in chunk 1 */
  uint64_t m0 = meta_bytes(p);
  ck_ok(kvp_seq_add(p, 7, &sc));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(positions(p, 7), 8);
  uint64_t one = meta_bytes(p) - m0;
  ck_ok(kvp_seq_free(p, 7));
  ck_ok(kvp_check(p));
  TOK[9] = keep;
  m0 = meta_bytes(p);
  sc = with_tokens(41); /* max hit: (41 - 1) / 8 = 5 chunks */
  ck_ok(kvp_seq_add(p, 2, &sc));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(positions(p, 2), 40);
  ck_assert_uint_eq(meta_bytes(p) - m0, one); /* no per-block metadata: 5 chunks cost what 1 did */
  ck_assert_uint_eq(fingerprint(p).alloc, alloc0); /* no page either */
  /* seq_info counts the shared pages in seq 2 too */
  kvp_seq_desc d1 = {.struct_size = sizeof d1}, d2 = {.struct_size = sizeof d2};
  ck_ok(kvp_seq_info(p, 2, &d2));
  ck_assert_uint_eq(d2.tokens_retained, 40ull * L * H);
  uint64_t pages2 = 0;
  for (int t = 0; t < KVP_PAGE_TYPE_COUNT; t++) pages2 += d2.page_types[t].npages;
  ck_assert_uint_gt(pages2, 0);
  ck_ok(kvp_seq_info(p, 1, &d1));
  uint64_t pages1 = 0;
  for (int t = 0; t < KVP_PAGE_TYPE_COUNT; t++) pages1 += d1.page_types[t].npages;
  ck_assert_uint_ge(pages1, pages2);
  /* reads and views see seq 1's blocks */
  take(p, 1, &S1);
  take(p, 2, &S2);
  same_prefix(&S1, &S2, 40, L, H);
  kvp_view *view;
  ck_ok(kvp_view_acquire(p, 2, 1, &view));
  ck_assert_uint_eq(view->n_blocks, 5 * H);
  /* a fork of the attached sequence holds the chunks too (and appends its own) */
  m0 = meta_bytes(p);
  ck_ok(kvp_seq_fork(p, 2, 3));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(positions(p, 3), 40);
  step(p, 3, 300, 40, 5);
  step(p, 2, 200, 40, 5);
  snap *S3 = malloc(sizeof *S3);
  take(p, 3, S3);
  same_prefix(&S1, S3, 40, L, H);
  /* the sequence that computed the chunks evicts over them, then goes */
  ck_ok(kvp_evict(p, 1, 0, 0, 0));
  ck_ok(kvp_check(p));
  ck_ok(kvp_evict(p, 1, 2, 1, 1));
  ck_ok(kvp_check(p));
  take(p, 2, &S2);
  same_prefix(&S1, &S2, 40, L, H); /* S1: seq 1 as it was */
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(chunks_now(p), 5); /* held by 2 and 3 */
  take(p, 2, &S2);
  same_prefix(&S1, &S2, 40, L, H);
  kvp_view_release(p, view);
  ck_ok(kvp_check(p));
  /* the fork evicts over the shared chunks: its own reference goes, seq 2 keeps them */
  ck_ok(kvp_evict(p, 3, 1, 0, 0));
  ck_ok(kvp_check(p));
  kvp_read_req q = {.struct_size = sizeof q, .head = 0, .out_dtype = KVP_DTYPE_F32, .k_out = S3->k[1][0],
                    .v_out = S3->v[1][0], .positions_out = S3->pos[1][0], .capacity_tokens = MAXT};
  ck_ok(kvp_read(p, 3, 1, &q));
  ck_assert_uint_eq(q.n_tokens, 5); /* step 0 (the 40 attached tokens) gone from (1, 0) */
  ck_assert_uint_eq(S3->pos[1][0][0], 40);
  take(p, 2, &S2);
  same_prefix(&S1, &S2, 40, L, H);
  /* seq 2 goes: the chunks' last holder (seq 3 let go when it evicted) */
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(chunks_now(p), 0);
  take(p, 3, S3);
  same_prefix(&S1, S3, 40, 1, 0);
  /* seq 3 owns the blocks alone now: its eviction gives pages back */
  uint64_t before = fingerprint(p).alloc;
  ck_ok(kvp_evict(p, 3, 0, 1, 0));
  ck_ok(kvp_check(p));
  ck_assert_uint_lt(fingerprint(p).alloc, before);
  ck_ok(kvp_seq_free(p, 3));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(fingerprint(p).alloc, 0);
  free(S3);
  kvp_pool_destroy(p);
}
END_TEST

/* A shared prefix offloaded with one sequence: its chunks go under their
 * content keys once; the restore shares the pool's copy. */
START_TEST(offload_shared_prefix) {
  NEED_SERVER();
  kvp_pool *p = mkpool("kv=nvfp4", D);
  kvp_store *st = mkstore(NULL);
  for (uint32_t i = 0; i < MAXT; i++) TOK[i] = i * 5 + 1;
  kvp_seq_config sc = with_tokens(70);
  ck_ok(kvp_seq_add(p, 1, &sc));
  step(p, 1, 100, 0, 70);
  ck_ok(kvp_seq_add(p, 2, &sc));
  ck_assert_uint_eq(positions(p, 2), 64);
  step(p, 2, 100, 64, 6);
  take(p, 2, &S1);
  fp before = fingerprint(p);
  ck_ok(kvp_seq_offload(p, 2, st));
  ck_ok(kvp_check(p));
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  uint64_t first = s.store_offload_bytes;
  ck_ok(kvp_seq_restore(p, 2, st));
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  take(p, 2, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  /* again: the content chunks are in the store already, only the tail moves */
  ck_ok(kvp_seq_offload(p, 2, st));
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_lt(s.store_offload_bytes - first, first / 2);
  /* restored into a fresh pool: the content chunks come from the store */
  kvp_pool *q = mkpool("kv=nvfp4", D);
  ck_ok(kvp_seq_restore(q, 2, st));
  ck_ok(kvp_check(q));
  take(q, 2, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  ck_ok(kvp_stats_get(q, &s));
  ck_assert_uint_eq(s.prefix_chunks.current, 8);
  kvp_pool_destroy(q);
  kvp_store_close(st);
  kvp_pool_destroy(p);
}
END_TEST

/* Two processes: the child computes a prompt and publishes its prefix; the
 * parent, in its own pool, fetches it instead of recomputing. */
START_TEST(two_processes_share_a_prefix) {
  NEED_SERVER();
  for (uint32_t i = 0; i < MAXT; i++) TOK[i] = i * 11 + 2;
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    kvp_pool *p = mkpool("k=nvfp4,v=int8", D);
    kvp_store *st = mkstore("?prefix=share:");
    kvp_seq_config sc = with_tokens(100);
    int ok = kvp_seq_add(p, 5, &sc) == 0;
    kvgen_init(&G);
    ck_ok(kvp_step_begin(p, 5, 100, 0));
    for (uint32_t l = 0; l < L; l++) {
      kvgen_fill(&G, 77, l, 0, 100, H, D, K, V);
      ok = ok && kvp_append(p, 5, l, &(kvp_kv){K, V, NULL}) == 0;
    }
    ok = ok && kvp_step_end(p, 5) == 0;
    uint32_t pub = 0;
    ok = ok && kvp_prefix_publish(p, 5, st, &pub) == 0 && pub == 96;
    kvp_store_close(st);
    kvp_pool_destroy(p);
    _exit(ok ? 0 : 1);
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the publishing process failed");
  kvp_pool *p = mkpool("k=nvfp4,v=int8", D);
  kvp_store *st = mkstore("?prefix=share:");
  kvp_seq_config sc = with_tokens(90); /* a shorter prompt with the same start */
  ck_ok(kvp_seq_add(p, 9, &sc));
  ck_assert_uint_eq(positions(p, 9), 0);
  uint32_t got = 0;
  ck_ok(kvp_prefix_fetch(p, 9, st, &got));
  ck_assert_uint_eq(got, 88);
  ck_assert_uint_eq(positions(p, 9), 88);
  ck_ok(kvp_check(p));
  step(p, 9, 77, 88, 2);
  /* the same values the other process computed */
  kvp_pool *ref = mkpool("k=nvfp4,v=int8", D);
  ck_ok(kvp_seq_add(ref, 9, NULL));
  step(ref, 9, 77, 0, 90);
  take(ref, 9, &S1);
  take(p, 9, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.store_prefix_tokens, 88);
  /* a second sequence of this pool shares the fetched chunks locally */
  ck_ok(kvp_seq_add(p, 10, &sc));
  ck_assert_uint_eq(positions(p, 10), 88);
  /* a fetch after the sequence's own appends is refused by name */
  ck_status(kvp_prefix_fetch(p, 9, st, &got), KVP_EBUSY);
  ck_msg("seq 9");
  ck_ok(kvp_check(p));
  kvp_pool_destroy(ref);
  kvp_store_close(st);
  kvp_pool_destroy(p);
}
END_TEST

/* max_bytes: a write that would take the server's memory past the cap is
 * refused with KVP_ENOSPC naming the cap; an offload then frees nothing, a
 * publish keeps what the store held and says so; reads are never refused. */
START_TEST(store_max_bytes) {
  NEED_SERVER();
  kvp_pool *p = mkpool("kv=int8", D);
  kvp_store *tiny = mkstore("?max_bytes=1"), *roomy = mkstore("?max_bytes=1T");
  for (uint32_t i = 0; i < MAXT; i++) TOK[i] = i * 17 + 9;
  kvp_seq_config sc = with_tokens(45);
  ck_ok(kvp_seq_add(p, 1, &sc));
  step(p, 1, 100, 0, 30);
  step(p, 1, 100, 30, 15); /* chunks 0..4 */
  TOK[41] = 77777;
  sc = with_tokens(70);
  ck_ok(kvp_seq_add(p, 2, &sc)); /* chunks 0..4 attached, 5..7 its own */
  ck_assert_uint_eq(positions(p, 2), 40);
  step(p, 2, 200, 40, 30);
  fp before = fingerprint(p);
  take(p, 1, &S1);
  ck_status(kvp_seq_offload(p, 1, tiny), KVP_ENOSPC);
  ck_msg("max_bytes=1");
  ck_msg("kvp:");
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  take(p, 1, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  uint32_t pub = 99;
  ck_status(kvp_prefix_publish(p, 1, tiny, &pub), KVP_ENOSPC);
  ck_assert_uint_eq(pub, 0);
  ck_msg("max_bytes=1");
  ck_ok(kvp_prefix_publish(p, 1, roomy, &pub));
  ck_assert_uint_eq(pub, 40);
  ck_status(kvp_prefix_publish(p, 2, tiny, &pub), KVP_ENOSPC); /* its first 5 chunks are there already */
  ck_assert_uint_eq(pub, 40);
  ck_msg("holds its first 40 tokens");
  ck_ok(kvp_check(p));
  same_fp(fingerprint(p), before);
  /* out through the roomy handle, back through the tiny one */
  ck_ok(kvp_seq_offload(p, 1, roomy));
  ck_ok(kvp_check(p));
  ck_ok(kvp_seq_restore(p, 1, tiny));
  ck_ok(kvp_check(p));
  take(p, 1, &S2);
  ck_assert_mem_eq(&S1, &S2, sizeof S1);
  kvp_store_close(tiny);
  kvp_store_close(roomy);
  kvp_pool_destroy(p);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("store");
  TCase *t = tcase_create("store");
  tcase_add_checked_fixture(t, setup, teardown);
  tcase_set_timeout(t, 120);
  tcase_add_loop_test(t, offload_restore_roundtrip, 0, 4);
  tcase_add_test(t, bad_urls);
#ifdef KVP_HAVE_HIREDIS
  tcase_add_test(t, restore_refuses_bad_blobs);
  tcase_add_test(t, server_down_and_timeout);
  tcase_add_test(t, server_killed_mid_offload);
  tcase_add_test(t, store_max_bytes);
#endif
  tcase_add_loop_test(t, prefix_sharing_in_pool, 0, 4);
  tcase_add_loop_test(t, prefix_chunk_references, 0, 4);
  tcase_add_test(t, offload_shared_prefix);
  tcase_add_test(t, two_processes_share_a_prefix);
  suite_add_tcase(s, t);
  return s;
}

int main(void) { return it_run(suite()); }
