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

int kvp__orders_alloc(kvp__orders *o, uint32_t L, uint32_t H, uint32_t K, uint32_t s, kvp__meta *m) {
  memset(o, 0, sizeof *o);
  if (L == 0 || H == 0 || L > UINT16_MAX || H > UINT16_MAX)
    return kvp__err(KVP_EINVAL, "orders: layers %u and heads %u must be in 1..65535", L, H);
  if (K < 2 || s > K - 1)
    return kvp__err(KVP_EINVAL, "orders: %u scales with %u sink scales: need K >= 2 and s <= K-1", K, s);
  *o = (kvp__orders){L, H, K, s, K - 1 - s, false, NULL, m};
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
  if (K >= 2 && s <= K - 1 && json_array_size(root) != K - 1 - s) /* before the allocation it sizes */
    return kvp__err(KVP_EFORMAT, "%s: %zu lists, expected %u (0-based source scales %u..%u of %u scales with %u "
                    "sink scales)", name, json_array_size(root), K - 1 - s, s, K - 2, K, s);
  int rc = kvp__orders_alloc(o, L, H, K, s, m);
  if (rc) return rc;
  rc = lists_read(o, root, true, name);
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
  const json_t *kind = json_object_get(root, "kind");
  bool cas = json_is_string(kind) && !strcmp(json_string_value(kind), "cas");
  if (kind && !cas && !(json_is_string(kind) && !strcmp(json_string_value(kind), "scas")))
    return kvp__err(KVP_EFORMAT, "%s: field \"kind\" is not \"scas\" (an order per source scale) or \"cas\" "
                    "(one order of whole heads)", name);
  /* the lists' count and lengths before the allocation they size: a small
   * file cannot make the loader take more than its lists hold */
  const json_t *lists = json_object_get(root, "orders");
  uint32_t n_orders = fk - 1 - fs, want = cas ? 1 : n_orders;
  if (!json_is_array(lists) || json_array_size(lists) != want)
    return cas ? kvp__err(KVP_EFORMAT, "%s: field \"orders\" has %zu lists, expected 1 (kind \"cas\")", name,
                          json_array_size(lists))
               : kvp__err(KVP_EFORMAT, "%s: field \"orders\" has %zu lists, expected %u (0-based source scales "
                          "%u..%u)", name, json_array_size(lists), n_orders, fs, fk - 2);
  for (uint32_t j = 0; j < want; j++) {
    const json_t *list = json_array_get(lists, j);
    if (!json_is_array(list) || json_array_size(list) != (size_t)fl * fh)
      return kvp__err(KVP_EFORMAT, "%s: list %u (0-based source scale %u): %zu entries, expected L*H = %llu", name, j,
                      fs + j, json_is_array(list) ? json_array_size(list) : 0, (unsigned long long)fl * fh);
  }
  if ((rc = kvp__orders_alloc(o, fl, fh, fk, fs, m))) return rc;
  o->cas = cas;
  if (cas && o->n_orders) { /* one list, then the same in every source's place */
    uint32_t n = o->n_orders, T = fl * fh;
    o->n_orders = 1;
    rc = lists_read(o, lists, false, name);
    o->n_orders = n;
    for (uint32_t j = 1; !rc && j < n; j++) memcpy(o->pairs + (size_t)j * T, o->pairs, (size_t)T * sizeof *o->pairs);
  } else {
    rc = lists_read(o, lists, false, name);
  }
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
  for (uint32_t j = 0; lists && j < (o->cas && o->n_orders ? 1 : o->n_orders); j++) {
    json_t *list = json_array();
    for (uint32_t e = 0; list && e < T; e++) {
      uint32_t p = o->pairs[(size_t)j * T + e];
      json_array_append_new(list, json_pack("[II]", (json_int_t)(p / o->n_heads), (json_int_t)(p % o->n_heads)));
    }
    json_array_append_new(lists, list);
  }
  return json_pack("{s:s, s:i, s:s, s:I, s:I, s:I, s:I, s:[ss], s:o, s:s}", "format", KVP__ORDERS_FORMAT,
                   "version", KVP__ORDERS_VERSION, "kind", o->cas ? "cas" : "scas", "layers",
                   (json_int_t)o->n_layers, "heads", (json_int_t)o->n_heads, "scales", (json_int_t)o->n_scales,
                   "sink_scales", (json_int_t)o->n_sinks, "pair", "layer", "head", "orders", lists, "checksum", sum);
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

int kvp__orders_write_shipped(const kvp__orders *o, const char *path) {
  if (!o || !path) return kvp__err(KVP_EINVAL, "orders write: %s is NULL", o ? "path" : "orders");
  uint32_t T = o->n_layers * o->n_heads;
  FILE *f = fopen(path, "w");
  if (!f) return kvp__err(KVP_EINVAL, "orders write: cannot create %s: %s", path, strerror(errno));
  int bad = fputc('[', f) == EOF;
  for (uint32_t j = 0; !bad && j < o->n_orders; j++) {
    bad |= fprintf(f, "%s[", j ? ", " : "") < 0;
    for (uint32_t e = 0; !bad && e < T; e++) {
      uint32_t p = o->pairs[(size_t)j * T + e];
      bad |= fprintf(f, "%s[%u, %u]", e ? ", " : "", p % o->n_heads, p / o->n_heads) < 0;
    }
    bad |= fputc(']', f) == EOF;
  }
  bad |= fputs("]\n", f) == EOF;
  bad |= fclose(f) != 0;
  return bad ? kvp__err(KVP_EINVAL, "orders write: cannot write %s: %s", path, strerror(errno)) : KVP_OK;
}
