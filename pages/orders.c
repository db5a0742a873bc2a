/*
 * pages/orders.c - HeatKV removal orders: loading the shipped JSON format
 * and kvpool's own, writing kvpool's, and a synthetic generator.
 *
 * Invariants of a loaded kvp__orders o (T = L*H):
 *   n_orders = K - 1 - s;  list j belongs to 0-based source scale s + j
 *   (paper scale s + j + 1);  each list is a permutation of 0..T-1
 *   (pair id = layer * H + head).
 *
 * Shipped format (third-party, github.com/arm-research/heatkv orders/):
 *   [ [[head, layer], ... T pairs], ... one list per source s..K-2 ]
 * kvpool format: see kvp__orders_write in heatkv.h; its pairs are
 * [layer, head] and a checksum covers geometry and contents.
 */
#include "heatkv.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- allocation and checksum ------------------------------------------- */

static size_t pairs_bytes(const kvp__orders *o) {
  return (size_t)o->n_orders * o->n_layers * o->n_heads * sizeof(uint32_t);
}

static int orders_init(kvp__orders *o, uint32_t L, uint32_t H, uint32_t K, uint32_t s, kvp__meta *m) {
  memset(o, 0, sizeof *o);
  if (L == 0 || H == 0 || L > UINT16_MAX || H > UINT16_MAX)
    return kvp__err(KVP_EINVAL, "orders: layers %u and heads %u must be in 1..65535", L, H);
  if (K < 2 || s > K - 1)
    return kvp__err(KVP_EINVAL, "orders: %u scales with %u sink scales: need K >= 2 and s <= K-1", K, s);
  *o = (kvp__orders){L, H, K, s, K - 1 - s, NULL, m};
  if (pairs_bytes(o) == 0) return KVP_OK;
  o->pairs = kvp__meta_alloc(m, pairs_bytes(o));
  if (!o->pairs) {
    memset(o, 0, sizeof *o);
    return kvp__err(KVP_ENOMEM, "orders: %u lists of %u pairs", K - 1 - s, L * H);
  }
  return KVP_OK;
}

void kvp__orders_free(kvp__orders *o) {
  if (!o) return;
  if (o->pairs) kvp__meta_free(o->meta, o->pairs, pairs_bytes(o));
  memset(o, 0, sizeof *o);
}

static uint64_t fnv_u32(uint64_t h, uint32_t v) {
  for (int i = 0; i < 4; i++) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t kvp__orders_checksum(const kvp__orders *o) {
  uint64_t h = 0xcbf29ce484222325ULL;
  h = fnv_u32(fnv_u32(fnv_u32(fnv_u32(h, o->n_layers), o->n_heads), o->n_scales), o->n_sinks);
  size_t n = (size_t)o->n_orders * o->n_layers * o->n_heads;
  for (size_t i = 0; i < n; i++) h = fnv_u32(fnv_u32(h, o->pairs[i] / o->n_heads), o->pairs[i] % o->n_heads);
  return h;
}

/* ---- one list of pairs --------------------------------------------------
 * head_first: entries are [head, layer] (shipped) or [layer, head] (ours).
 * seen[T] is scratch; entry e of list j lands at pairs[j*T + e]. */

static int list_read(kvp__orders *o, const json_t *list, uint32_t j, bool head_first, const char *name,
                     uint32_t *seen) {
  uint32_t T = o->n_layers * o->n_heads, src = o->n_sinks + j;
  if (!json_is_array(list) || json_array_size(list) != T)
    return kvp__err(KVP_EFORMAT, "%s: list %u (0-based source scale %u, paper scale %u): %zu entries, expected "
                    "L*H = %u", name, j, src, src + 1, json_is_array(list) ? json_array_size(list) : 0, T);
  memset(seen, 0, T * sizeof *seen);
  for (uint32_t e = 0; e < T; e++) {
    const json_t *pr = json_array_get(list, e);
    const json_t *a = json_array_get(pr, 0), *b = json_array_get(pr, 1);
    if (!json_is_array(pr) || json_array_size(pr) != 2 || !json_is_integer(a) || !json_is_integer(b))
      return kvp__err(KVP_EFORMAT, "%s: list %u, entry %u: expected a [%s] pair of integers", name, j, e,
                      head_first ? "head, layer" : "layer, head");
    json_int_t hv = json_integer_value(head_first ? a : b), lv = json_integer_value(head_first ? b : a);
    if (hv < 0 || hv >= o->n_heads)
      return kvp__err(KVP_EFORMAT, "%s: list %u, entry %u: head %lld outside 0..%u", name, j, e, (long long)hv,
                      o->n_heads - 1);
    if (lv < 0 || lv >= o->n_layers)
      return kvp__err(KVP_EFORMAT, "%s: list %u, entry %u: layer %lld outside 0..%u", name, j, e, (long long)lv,
                      o->n_layers - 1);
    uint32_t p = (uint32_t)lv * o->n_heads + (uint32_t)hv;
    if (seen[p])
      return kvp__err(KVP_EFORMAT, "%s: list %u, entry %u: (layer %lld, head %lld) repeats entry %u", name, j, e,
                      (long long)lv, (long long)hv, seen[p] - 1);
    seen[p] = e + 1;
    o->pairs[(size_t)j * T + e] = p;
  }
  return KVP_OK; /* T distinct pairs in range: a permutation */
}

static int lists_read(kvp__orders *o, const json_t *lists, bool head_first, const char *name) {
  uint32_t T = o->n_layers * o->n_heads;
  uint32_t *seen = malloc((size_t)T * sizeof *seen);
  if (!seen) return kvp__err(KVP_ENOMEM, "%s: scratch for %u pairs", name, T);
  int rc = KVP_OK;
  for (uint32_t j = 0; j < o->n_orders && rc == KVP_OK; j++)
    rc = list_read(o, json_array_get(lists, j), j, head_first, name, seen);
  free(seen);
  return rc;
}

/* ---- the shipped format ------------------------------------------------ */

static int parse_shipped(kvp__orders *o, const json_t *root, const char *name, uint32_t L, uint32_t H, uint32_t K,
                         uint32_t s, kvp__meta *m) {
  if (L == KVP__ORDERS_ANY || H == KVP__ORDERS_ANY || K == KVP__ORDERS_ANY || s == KVP__ORDERS_ANY)
    return kvp__err(KVP_EINVAL, "%s: the shipped format names no geometry: layers, heads, scales and sink "
                    "scales must be given", name);
  int rc = orders_init(o, L, H, K, s, m);
  if (rc) return rc;
  if (json_array_size(root) != o->n_orders) {
    rc = kvp__err(KVP_EFORMAT, "%s: %zu lists, expected %u (0-based source scales %u..%u of %u scales with %u "
                  "sink scales)", name, json_array_size(root), o->n_orders, s, K - 2, K, s);
  } else {
    rc = lists_read(o, root, true, name);
  }
  if (rc) kvp__orders_free(o);
  return rc;
}

/* ---- kvpool's format --------------------------------------------------- */

static int field_u32(const json_t *root, const char *key, const char *name, uint32_t want, uint32_t *out) {
  const json_t *v = json_object_get(root, key);
  if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT16_MAX)
    return kvp__err(KVP_EFORMAT, "%s: field \"%s\" missing or not an integer in 0..65535", name, key);
  *out = (uint32_t)json_integer_value(v);
  if (want != KVP__ORDERS_ANY && *out != want)
    return kvp__err(KVP_EFORMAT, "%s: field \"%s\" is %u, expected %u", name, key, *out, want);
  return KVP_OK;
}

static int header_check(const json_t *root, const char *name) {
  const json_t *f = json_object_get(root, "format"), *v = json_object_get(root, "version");
  const json_t *pr = json_object_get(root, "pair");
  if (!json_is_string(f) || strcmp(json_string_value(f), KVP__ORDERS_FORMAT) != 0)
    return kvp__err(KVP_EFORMAT, "%s: field \"format\" is not \"%s\"", name, KVP__ORDERS_FORMAT);
  if (!json_is_integer(v) || json_integer_value(v) != KVP__ORDERS_VERSION)
    return kvp__err(KVP_EFORMAT, "%s: field \"version\" is not %d (this kvpool reads version %d)", name,
                    KVP__ORDERS_VERSION, KVP__ORDERS_VERSION);
  if (json_array_size(pr) != 2 || !json_is_string(json_array_get(pr, 0)) ||
      strcmp(json_string_value(json_array_get(pr, 0)), "layer") != 0 ||
      !json_is_string(json_array_get(pr, 1)) || strcmp(json_string_value(json_array_get(pr, 1)), "head") != 0)
    return kvp__err(KVP_EFORMAT, "%s: field \"pair\" is not [\"layer\", \"head\"]", name);
  return KVP_OK;
}

static int checksum_check(const kvp__orders *o, const json_t *root, const char *name) {
  const json_t *c = json_object_get(root, "checksum");
  char want[32];
  snprintf(want, sizeof want, "fnv1a64:%016" PRIx64, kvp__orders_checksum(o));
  if (!json_is_string(c))
    return kvp__err(KVP_EFORMAT, "%s: field \"checksum\" missing (the orders hash to %s)", name, want);
  if (strcmp(json_string_value(c), want) != 0)
    return kvp__err(KVP_EFORMAT, "%s: field \"checksum\" is \"%s\", the orders hash to %s", name,
                    json_string_value(c), want);
  return KVP_OK;
}

static int parse_kvpool(kvp__orders *o, const json_t *root, const char *name, uint32_t L, uint32_t H, uint32_t K,
                        uint32_t s, kvp__meta *m) {
  uint32_t fl, fh, fk, fs;
  int rc = header_check(root, name);
  if (!rc) rc = field_u32(root, "layers", name, L, &fl);
  if (!rc) rc = field_u32(root, "heads", name, H, &fh);
  if (!rc) rc = field_u32(root, "scales", name, K, &fk);
  if (!rc) rc = field_u32(root, "sink_scales", name, s, &fs);
  if (rc) return rc;
  if (fl == 0 || fh == 0) return kvp__err(KVP_EFORMAT, "%s: field \"%s\" is 0", name, fl ? "heads" : "layers");
  if (fk < 2 || fs > fk - 1)
    return kvp__err(KVP_EFORMAT, "%s: field \"sink_scales\" is %u with \"scales\" %u: need scales >= 2 and "
                    "sink_scales <= scales - 1", name, fs, fk);
  if ((rc = orders_init(o, fl, fh, fk, fs, m))) return rc;
  const json_t *lists = json_object_get(root, "orders");
  if (!json_is_array(lists) || json_array_size(lists) != o->n_orders)
    rc = kvp__err(KVP_EFORMAT, "%s: field \"orders\" has %zu lists, expected %u (0-based source scales %u..%u)",
                  name, json_array_size(lists), o->n_orders, fs, fk - 2);
  if (!rc) rc = lists_read(o, lists, false, name);
  if (!rc) rc = checksum_check(o, root, name);
  if (rc) kvp__orders_free(o);
  return rc;
}

/* ---- entry points ------------------------------------------------------ */

static int parse_root(kvp__orders *o, json_t *root, const char *name, uint32_t L, uint32_t H, uint32_t K,
                      uint32_t s, kvp__meta *m) {
  int rc;
  if (json_is_array(root)) rc = parse_shipped(o, root, name, L, H, K, s, m);
  else if (json_is_object(root)) rc = parse_kvpool(o, root, name, L, H, K, s, m);
  else rc = kvp__err(KVP_EFORMAT, "%s: top level is neither a list (shipped HeatKV orders) nor an object "
                     "(kvpool orders)", name);
  json_decref(root);
  return rc;
}

int kvp__orders_parse(kvp__orders *o, const char *text, size_t len, const char *name, uint32_t L, uint32_t H,
                      uint32_t K, uint32_t s, kvp__meta *m) {
  json_error_t je;
  memset(o, 0, sizeof *o);
  if (!text) return kvp__err(KVP_EINVAL, "orders: text is NULL");
  name = name ? name : "<orders>";
  json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
  if (!root) return kvp__err(KVP_EFORMAT, "%s:%d:%d: %s", name, je.line, je.column, je.text);
  return parse_root(o, root, name, L, H, K, s, m);
}

int kvp__orders_load(kvp__orders *o, const char *path, uint32_t L, uint32_t H, uint32_t K, uint32_t s,
                     kvp__meta *m) {
  json_error_t je;
  memset(o, 0, sizeof *o);
  if (!path) return kvp__err(KVP_EINVAL, "orders: path is NULL");
  json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
  if (!root && json_error_code(&je) == json_error_cannot_open_file)
    return kvp__err(KVP_ENOENT, "orders: cannot open %s: %s", path, je.text);
  if (!root) return kvp__err(KVP_EFORMAT, "%s:%d:%d: %s", path, je.line, je.column, je.text);
  return parse_root(o, root, path, L, H, K, s, m);
}

/* ---- writer ------------------------------------------------------------ */

static json_t *orders_json(const kvp__orders *o) {
  uint32_t T = o->n_layers * o->n_heads;
  char sum[32];
  snprintf(sum, sizeof sum, "fnv1a64:%016" PRIx64, kvp__orders_checksum(o));
  json_t *lists = json_array();
  for (uint32_t j = 0; lists && j < o->n_orders; j++) {
    json_t *list = json_array();
    for (uint32_t e = 0; list && e < T; e++) {
      uint32_t p = o->pairs[(size_t)j * T + e];
      json_array_append_new(list, json_pack("[II]", (json_int_t)(p / o->n_heads), (json_int_t)(p % o->n_heads)));
    }
    json_array_append_new(lists, list);
  }
  return json_pack("{s:s, s:i, s:I, s:I, s:I, s:I, s:[ss], s:o, s:s}", "format", KVP__ORDERS_FORMAT, "version",
                   KVP__ORDERS_VERSION, "layers", (json_int_t)o->n_layers, "heads", (json_int_t)o->n_heads,
                   "scales", (json_int_t)o->n_scales, "sink_scales", (json_int_t)o->n_sinks, "pair", "layer",
                   "head", "orders", lists, "checksum", sum);
}

int kvp__orders_write(const kvp__orders *o, const char *path) {
  if (!o || !path) return kvp__err(KVP_EINVAL, "orders write: %s is NULL", o ? "path" : "orders");
  json_t *root = orders_json(o);
  if (!root) return kvp__err(KVP_ENOMEM, "orders write: building JSON for %s", path);
  errno = 0;
  int bad = json_dump_file(root, path, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(root);
  if (bad) return kvp__err(KVP_EINVAL, "orders write: cannot write %s: %s", path, errno ? strerror(errno) : "?");
  return KVP_OK;
}

/* ---- synthetic orders ---------------------------------------------------
 * Each (layer, head) gets one of Figure 3's patterns: how much a query at
 * paper scale tau attends to source scale i <= tau (unnormalized). The rows
 * are normalized over i <= tau, noised, and S-CAS(i) = mean over tau > i of
 * beta[tau][i] (Eq. 4); each source's order sorts pairs by ascending S-CAS,
 * ties by (head, layer) as in the shipped files. */

enum { PAT_RECENT, PAT_SELF, PAT_EARLY, PAT_SKIP, PAT_UNIFORM, PAT_FAR, PAT_N };

static double pattern(int pat, uint32_t tau, uint32_t i, uint32_t s) {
  uint32_t d = tau - i; /* 0 = the query's own scale */
  switch (pat) {
  case PAT_RECENT: return exp(-1.3 * d);                      /* Fig. 3b: recent scales */
  case PAT_SELF: return d == 0 ? 1.0 : 0.01;                 /* Fig. 3f: strict self-attention */
  case PAT_EARLY: return i <= s ? 1.0 : 0.02;                /* Fig. 3a: scale 1 and the sinks */
  case PAT_SKIP: return d == 1 ? 0.01 : d <= 3 ? 1.0 : 0.1;  /* Fig. 3d: skips the previous scale */
  case PAT_UNIFORM: return 1.0;                              /* Fig. 3e: every scale alike */
  default: return exp(-0.6 * (i - 1));                        /* Fig. 3c: early scales */
  }
}

static uint64_t splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static double unit_rand(uint64_t *x) { return (double)(splitmix(x) >> 11) * 0x1.0p-53; }

/* Early layers lean to recent-scale attention, later ones spread out. */
static int pick_pattern(uint64_t *rng, uint32_t l, uint32_t L) {
  double depth = L > 1 ? (double)l / (L - 1) : 0.0, u = unit_rand(rng);
  double recent = 0.7 - 0.5 * depth;
  if (u < recent) return PAT_RECENT;
  return PAT_SELF + (int)((u - recent) / (1.0 - recent) * (PAT_N - 1)) % (PAT_N - 1);
}

typedef struct scored {
  double scas;  /* S-CAS of the pair for one source */
  uint32_t l;   /* layer */
  uint32_t h;   /* head */
} scored;

static int scored_cmp(const void *pa, const void *pb) {
  const scored *a = pa, *b = pb;
  if (a->scas != b->scas) return a->scas < b->scas ? -1 : 1;
  if (a->h != b->h) return a->h < b->h ? -1 : 1;
  return (a->l > b->l) - (a->l < b->l);
}

/* S-CAS of pair (pattern pat, noise stream rng) for paper source i. */
static double scas_of(int pat, uint32_t i, uint32_t K, uint32_t s, uint64_t *rng) {
  double sum = 0;
  for (uint32_t tau = i + 1; tau <= K; tau++) {
    double row = 0;
    for (uint32_t j = 1; j <= tau; j++) row += pattern(pat, tau, j, s);
    sum += pattern(pat, tau, i, s) * (0.75 + 0.5 * unit_rand(rng)) / row;
  }
  return sum / (K - i);
}

int kvp__orders_synthetic(kvp__orders *o, uint32_t L, uint32_t H, uint32_t K, uint32_t s, uint64_t seed,
                          kvp__meta *m) {
  int rc = orders_init(o, L, H, K, s, m);
  if (rc) return rc;
  uint32_t T = L * H;
  scored *sc = malloc((size_t)T * sizeof *sc);
  int *pat = malloc((size_t)T * sizeof *pat);
  if (!sc || !pat) {
    free(sc), free(pat), kvp__orders_free(o);
    return kvp__err(KVP_ENOMEM, "orders: synthetic scratch for %u pairs", T);
  }
  uint64_t rng = seed;
  for (uint32_t p = 0; p < T; p++) pat[p] = pick_pattern(&rng, p / H, L);
  for (uint32_t j = 0; j < o->n_orders; j++) {
    uint32_t i = kvp__heatkv_k1(s + j); /* paper source scale */
    for (uint32_t p = 0; p < T; p++) sc[p] = (scored){scas_of(pat[p], i, K, s, &rng), p / H, p % H};
    qsort(sc, T, sizeof *sc, scored_cmp);
    for (uint32_t e = 0; e < T; e++) o->pairs[(size_t)j * T + e] = sc[e].l * H + sc[e].h;
  }
  free(sc), free(pat);
  return KVP_OK;
}
