/*
 * codecs/spec.c - the codec spec parser: which codec, with which
 * parameters, stores K and V of each layer.
 *
 *   "k=bf16,v=int8;layers=24-31:k=fp8"
 *    \_____________/ \______________/
 *        clause 1        clause 2 (overrides layers 24..31 of K)
 *
 * Invariant: on success every (layer, K|V) has exactly one binding (raw
 * unless a clause names it); on failure nothing is allocated and the
 * message quotes the spec with the column of the offending character.
 */
#include "codecs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct parser {
  const char *s; /* the spec */
  size_t i;      /* cursor */
} parser;

static int fail(const parser *p, size_t at, const char *what) {
  return kvp__err(KVP_EINVAL, "config.codecs: %s at column %zu of \"%s\" (at \"%.16s\")", what, at + 1, p->s,
                  p->s + at);
}

static bool is_name(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'; }

static bool eat(parser *p, const char *lit) {
  size_t n = strlen(lit);
  if (strncmp(p->s + p->i, lit, n) != 0) return false;
  p->i += n;
  return true;
}

static int number(parser *p, uint32_t *out) {
  size_t at = p->i;
  uint64_t v = 0;
  while (p->s[p->i] >= '0' && p->s[p->i] <= '9' && v <= 0xFFFFFFFFull) v = v * 10 + (uint64_t)(p->s[p->i++] - '0');
  if (p->i == at || v > 0xFFFFFFFFull) return fail(p, at, "expected a layer number");
  *out = (uint32_t)v;
  return KVP_OK;
}

/* "layers=A[-B]:" -> [lo, hi] */
static int layer_range(parser *p, uint32_t n_layers, uint32_t *lo, uint32_t *hi) {
  size_t at = p->i;
  int rc = number(p, lo);
  if (rc) return rc;
  *hi = *lo;
  if (eat(p, "-") && (rc = number(p, hi))) return rc;
  if (*lo > *hi || *hi >= n_layers) {
    char what[96];
    snprintf(what, sizeof what, "layers %u-%u outside 0-%u", *lo, *hi, n_layers - 1);
    return fail(p, at, what);
  }
  return eat(p, ":") ? KVP_OK : fail(p, p->i, "expected ':' after the layer range");
}

static const char *const raw_aliases[] = {"bf16", "fp16", "f16", "fp32", "f32"};

/* name[:params] -> codec id and owned parameter text. */
static int binding(parser *p, uint32_t *id, char **params) {
  size_t at = p->i;
  while (is_name(p->s[p->i])) p->i++;
  size_t name_len = p->i - at;
  if (!name_len) return fail(p, at, "expected a codec name");
  char name[32];
  if (name_len >= sizeof name) return fail(p, at, "codec name too long");
  memcpy(name, p->s + at, name_len);
  name[name_len] = 0;
  size_t pstart = p->i;
  while (p->s[p->i] && p->s[p->i] != ',' && p->s[p->i] != ';') p->i++;
  const char *ptext = p->s + pstart + (p->s[pstart] == ':'); /* params without the leading ':' */
  size_t plen = (size_t)(p->s + p->i - ptext);
  if (p->s[pstart] && p->s[pstart] != ':' && p->s[pstart] != ',' && p->s[pstart] != ';')
    return fail(p, pstart, "expected ':' before codec parameters");
  const char *alias = NULL;
  for (size_t k = 0; k < KVP__ARRAY_LEN(raw_aliases); k++)
    if (strcmp(name, raw_aliases[k]) == 0) alias = raw_aliases[k];
  if (kvp_codec_find(alias ? "raw" : name, id) != KVP_OK) {
    char what[64];
    snprintf(what, sizeof what, "unknown codec \"%s\"", name);
    return fail(p, at, what);
  }
  size_t extra = alias ? strlen("dtype=") + strlen(alias) + 1 : 0;
  *params = malloc(plen + extra + 1);
  if (!*params) return kvp__err(KVP_ENOMEM, "codec spec parameters");
  int n = alias ? snprintf(*params, extra + 1, "dtype=%s%s", alias, plen ? ":" : "") : 0;
  memcpy(*params + n, ptext, plen);
  (*params)[n + (int)plen] = 0;
  return KVP_OK;
}

static int set(kvp__spec_entry *out, uint32_t slot, uint32_t id, const char *params) {
  char *copy = strdup(params);
  if (!copy) return kvp__err(KVP_ENOMEM, "codec spec parameters");
  free(out[slot].params);
  out[slot].id = id;
  out[slot].params = copy;
  return KVP_OK;
}

/* One clause; applies its assignments to out. */
static int clause(parser *p, uint32_t n_layers, kvp__spec_entry *out) {
  uint32_t lo = 0, hi = n_layers - 1;
  int rc;
  if (eat(p, "layers=") && (rc = layer_range(p, n_layers, &lo, &hi))) return rc;
  for (;;) {
    size_t at = p->i;
    bool k = false, v = false;
    if (eat(p, "kv=")) k = v = true;
    else if (eat(p, "k=")) k = true;
    else if (eat(p, "v=")) v = true;
    else return fail(p, at, "expected k=, v= or kv=");
    uint32_t id;
    char *params = NULL;
    if ((rc = binding(p, &id, &params))) return rc;
    for (uint32_t l = lo; !rc && l <= hi; l++) {
      if (k) rc = set(out, 2 * l, id, params);
      if (v && !rc) rc = set(out, 2 * l + 1, id, params);
    }
    free(params);
    if (rc) return rc;
    if (!eat(p, ",")) return KVP_OK;
  }
}

void kvp__codec_spec_free(kvp__spec_entry *e, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    free(e[i].params);
    e[i].params = NULL;
  }
}

int kvp__codec_spec_parse(const char *spec, uint32_t n_layers, kvp__spec_entry *out) {
  for (uint32_t i = 0; i < 2 * n_layers; i++) out[i] = (kvp__spec_entry){KVP__CODEC_RAW, NULL};
  int rc = KVP_OK;
  for (uint32_t i = 0; !rc && i < 2 * n_layers; i++) rc = set(out, i, KVP__CODEC_RAW, "");
  parser p = {spec ? spec : "", 0};
  while (!rc && p.s[p.i]) {
    rc = clause(&p, n_layers, out);
    if (!rc && p.s[p.i] && !eat(&p, ";")) rc = fail(&p, p.i, "expected ';' or the end");
    if (!rc && !p.s[p.i] && p.i && p.s[p.i - 1] == ';') rc = fail(&p, p.i - 1, "empty clause after ';'");
  }
  if (rc) kvp__codec_spec_free(out, 2 * n_layers);
  return rc;
}
