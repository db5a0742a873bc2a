/*
 * pages/mass.c - HeatKV calibration from attention mass (paper 001, Eqs.
 * 2-4): summaries beta[l][h][k1][k2] in, S-CAS and CAS removal orders out,
 * and the synthetic summaries that stand in for calibration files.
 *
 * beta[l][h][k1][k2], 0-based scales: the attention mass scale k1's queries
 * put on scale k2's keys, averaged over k1's queries (Eq. 2); 0 for k2 > k1.
 * Summaries of several prompts are averaged (sum, then divide by the prompt
 * count when the scores are taken). In the paper's 1-based numbering, with
 * s sink scales and K scales:
 *
 *   S-CAS(l, h, i) = 1/(K - i) sum_{tau = i+1..K} beta[tau][i]     (Eq. 4)
 *       for source scales s < i < K
 *   CAS(l, h)      = 1/(K - s) sum_{tau = s+1..K-1} beta[K][tau]   (Eq. 3)
 *
 * Orders sort pairs ascending by score (the least attended first, so it is
 * evicted first), ties by head, then layer: the tie rule of the shipped
 * orders. A summary file is checked on load: every value finite and in
 * [0, 1 + 1e-3], the upper triangle (k2 > k1) zero, each row's mass at most
 * 1 + 1e-3; a violation names the file and the [l][h][k1][k2] entry.
 */
#include "heatkv.h"

#include "../codecs/npy.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MASS_SLACK 1e-3 /* rounding room of the probability checks */

static size_t mass_len(const kvp__mass *m) {
  return (size_t)m->n_layers * m->n_heads * m->n_scales * m->n_scales;
}

int kvp__mass_init(kvp__mass *m, uint32_t L, uint32_t H, uint32_t K) {
  memset(m, 0, sizeof *m);
  if (L == 0 || H == 0 || L > UINT16_MAX || H > UINT16_MAX)
    return kvp__err(KVP_EINVAL, "attention mass: layers %u and heads %u must be in 1..65535", L, H);
  if (K < 2 || K > 4096) return kvp__err(KVP_EINVAL, "attention mass: %u scales outside 2..4096", K);
  *m = (kvp__mass){L, H, K, 0, NULL};
  if (!(m->beta = calloc(mass_len(m), sizeof *m->beta))) {
    memset(m, 0, sizeof *m);
    return kvp__err(KVP_ENOMEM, "attention mass: %u x %u x %u x %u", L, H, K, K);
  }
  return KVP_OK;
}

void kvp__mass_free(kvp__mass *m) {
  if (!m) return;
  free(m->beta);
  memset(m, 0, sizeof *m);
}

static double *beta_at(const kvp__mass *m, uint32_t l, uint32_t h, uint32_t k1, uint32_t k2) {
  return &m->beta[(((size_t)l * m->n_heads + h) * m->n_scales + k1) * m->n_scales + k2];
}

/* ---- adding one prompt's summary, checked ------------------------------- */

/* Values of one prompt come from get(ctx, l, h, k1, k2); they are checked
 * first and added only when all are valid, so a bad file changes nothing. */
typedef double (*mass_get_fn)(const void *ctx, uint32_t l, uint32_t h, uint32_t k1, uint32_t k2);

static int prompt_check(const kvp__mass *m, mass_get_fn get, const void *ctx, const char *name, uint32_t prompt) {
  for (uint32_t l = 0; l < m->n_layers; l++)
    for (uint32_t h = 0; h < m->n_heads; h++)
      for (uint32_t k1 = 0; k1 < m->n_scales; k1++) {
        double row = 0;
        for (uint32_t k2 = 0; k2 < m->n_scales; k2++) {
          double v = get(ctx, l, h, k1, k2);
          if (!isfinite(v) || v < 0 || v > 1 + MASS_SLACK)
            return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u][%u][%u][%u] = %g is not an attention mass in "
                            "[0, 1]", name, prompt, l, h, k1, k2, v);
          if (k2 > k1 && v != 0)
            return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u][%u][%u][%u] = %g: a scale cannot attend to a "
                            "later one (k2 > k1 must be 0)", name, prompt, l, h, k1, k2, v);
          row += v;
        }
        if (row > 1 + MASS_SLACK)
          return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u][%u][%u][*] sums to %g > 1", name, prompt, l, h, k1,
                          row);
      }
  return KVP_OK;
}

static void prompt_add(kvp__mass *m, mass_get_fn get, const void *ctx) {
  for (uint32_t l = 0; l < m->n_layers; l++)
    for (uint32_t h = 0; h < m->n_heads; h++)
      for (uint32_t k1 = 0; k1 < m->n_scales; k1++)
        for (uint32_t k2 = 0; k2 < m->n_scales; k2++) *beta_at(m, l, h, k1, k2) += get(ctx, l, h, k1, k2);
  m->n_prompts++;
}

/* ---- .npy --------------------------------------------------------------- */

typedef struct npy_ctx {
  const kvp__npy *a;
  uint64_t base; /* first element of the prompt */
  uint32_t H, K;
} npy_ctx;

static double npy_get(const void *vctx, uint32_t l, uint32_t h, uint32_t k1, uint32_t k2) {
  const npy_ctx *c = vctx;
  return kvp__npy_at(c->a, c->base + (((uint64_t)l * c->H + h) * c->K + k1) * c->K + k2);
}

static int add_npy(kvp__mass *m, const char *path) {
  kvp__npy a;
  int rc = kvp__npy_open(&a, path);
  if (rc) return rc;
  uint32_t P = 1;
  uint64_t d4[4] = {m->n_layers, m->n_heads, m->n_scales, m->n_scales};
  uint64_t d5[5] = {0, m->n_layers, m->n_heads, m->n_scales, m->n_scales};
  if (a.ndim == 5 && !(rc = kvp__npy_expect(&a, path, 5, d5))) P = (uint32_t)a.shape[0];
  else if (a.ndim != 5) rc = kvp__npy_expect(&a, path, 4, d4);
  uint64_t per = (uint64_t)m->n_layers * m->n_heads * m->n_scales * m->n_scales;
  for (uint32_t p = 0; !rc && p < P; p++) {
    npy_ctx c = {&a, p * per, m->n_heads, m->n_scales};
    rc = prompt_check(m, npy_get, &c, path, p);
  }
  for (uint32_t p = 0; !rc && p < P; p++) {
    npy_ctx c = {&a, p * per, m->n_heads, m->n_scales};
    prompt_add(m, npy_get, &c);
  }
  kvp__npy_close(&a);
  return rc;
}

/* ---- JSON ----------------------------------------------------------------
 * {"beta": [...]} or a bare list: [L][H][K][K] nested lists (one prompt) or
 * [P][L][H][K][K] (prompts). */

typedef struct json_ctx {
  const json_t *prompt; /* the [L][H][K][K] lists */
} json_ctx;

static double json_get(const void *vctx, uint32_t l, uint32_t h, uint32_t k1, uint32_t k2) {
  const json_ctx *c = vctx;
  const json_t *v = json_array_get(json_array_get(json_array_get(json_array_get(c->prompt, l), h), k1), k2);
  return json_is_number(v) ? json_number_value(v) : NAN;
}

/* Depth of nesting along the first entries. */
static uint32_t json_depth(const json_t *v) {
  uint32_t d = 0;
  while (json_is_array(v) && json_array_size(v)) v = json_array_get(v, 0), d++;
  return d;
}

/* Every list of the [L][H][K][K] tree has its extent and holds numbers. */
static int json_shape(const kvp__mass *m, const json_t *pr, const char *name, uint32_t p) {
  uint32_t ext[4] = {m->n_layers, m->n_heads, m->n_scales, m->n_scales};
  const char *what[4] = {"layers", "heads", "query scales", "source scales"};
  if (json_array_size(pr) != ext[0])
    return kvp__err(KVP_EFORMAT, "%s: prompt %u: %zu %s, expected %u", name, p, json_array_size(pr), what[0], ext[0]);
  for (uint32_t l = 0; l < ext[0]; l++) {
    const json_t *a = json_array_get(pr, l);
    if (!json_is_array(a) || json_array_size(a) != ext[1])
      return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u]: expected a list of %u %s", name, p, l, ext[1], what[1]);
    for (uint32_t h = 0; h < ext[1]; h++) {
      const json_t *b = json_array_get(a, h);
      if (!json_is_array(b) || json_array_size(b) != ext[2])
        return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u][%u]: expected a list of %u %s", name, p, l, h, ext[2],
                        what[2]);
      for (uint32_t k = 0; k < ext[2]; k++) {
        const json_t *c = json_array_get(b, k);
        if (!json_is_array(c) || json_array_size(c) != ext[3])
          return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u][%u][%u]: expected a list of %u %s", name, p, l, h,
                          k, ext[3], what[3]);
        for (uint32_t j = 0; j < ext[3]; j++)
          if (!json_is_number(json_array_get(c, j)))
            return kvp__err(KVP_EFORMAT, "%s: prompt %u, beta[%u][%u][%u][%u] is not a number", name, p, l, h, k, j);
      }
    }
  }
  return KVP_OK;
}

static int add_json(kvp__mass *m, const char *path) {
  json_error_t je;
  json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
  if (!root && json_error_code(&je) == json_error_cannot_open_file)
    return kvp__err(KVP_ENOENT, "%s: cannot open: %s", path, je.text);
  if (!root) return kvp__err(KVP_EFORMAT, "%s:%d:%d: %s", path, je.line, je.column, je.text);
  const json_t *b = json_is_object(root) ? json_object_get(root, "beta") : root;
  int rc = KVP_OK;
  uint32_t d = json_depth(b), P = d == 5 ? (uint32_t)json_array_size(b) : 1;
  if (!json_is_array(b) || (d != 4 && d != 5))
    rc = kvp__err(KVP_EFORMAT, "%s: field \"beta\" must be [L][H][K][K] or [prompts][L][H][K][K] nested lists",
                  path);
  for (uint32_t p = 0; !rc && p < P; p++) {
    json_ctx c = {d == 5 ? json_array_get(b, p) : b};
    if (!(rc = json_shape(m, c.prompt, path, p))) rc = prompt_check(m, json_get, &c, path, p);
  }
  for (uint32_t p = 0; !rc && p < P; p++) {
    json_ctx c = {d == 5 ? json_array_get(b, p) : b};
    prompt_add(m, json_get, &c);
  }
  json_decref(root);
  return rc;
}

int kvp__mass_add_file(kvp__mass *m, const char *path) {
  if (!m || !m->beta || !path) return kvp__err(KVP_EINVAL, "attention mass: %s is NULL", path ? "summary" : "path");
  size_t n = strlen(path);
  if (n >= 4 && !strcmp(path + n - 4, ".npy")) return add_npy(m, path);
  if (n >= 5 && !strcmp(path + n - 5, ".json")) return add_json(m, path);
  return kvp__err(KVP_EFORMAT, "%s: unknown summary format: expected a .npy or .json file", path);
}

/* ---- synthetic summaries -------------------------------------------------
 * Each (layer, head) gets one of Figure 3's patterns: how much a query at
 * paper scale tau attends to source scale i <= tau (unnormalized). A
 * prompt's rows are the pattern times noise in [0.75, 1.25), normalized to
 * a total mass of 0.9 (the rest goes to the text condition). */

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

int kvp__mass_synthetic(kvp__mass *m, uint32_t s, uint64_t seed, uint32_t prompts) {
  if (!m || !m->beta) return kvp__err(KVP_EINVAL, "attention mass: summary is NULL");
  uint32_t L = m->n_layers, H = m->n_heads, K = m->n_scales;
  uint64_t rng = seed;
  double *row = malloc((size_t)K * sizeof *row);
  int *pat = malloc((size_t)L * H * sizeof *pat);
  if (!row || !pat) {
    free(row), free(pat);
    return kvp__err(KVP_ENOMEM, "attention mass: synthetic scratch");
  }
  for (uint32_t p = 0; p < L * H; p++) pat[p] = pick_pattern(&rng, p / H, L); /* a head keeps its pattern */
  for (uint32_t pr = 0; pr < prompts; pr++) {
    for (uint32_t p = 0; p < L * H; p++)
      for (uint32_t k1 = 0; k1 < K; k1++) {
        double sum = 0;
        for (uint32_t k2 = 0; k2 <= k1; k2++) {
          row[k2] = pattern(pat[p], k1 + 1, k2 + 1, s) * (0.75 + 0.5 * unit_rand(&rng));
          sum += row[k2];
        }
        for (uint32_t k2 = 0; k2 <= k1; k2++) *beta_at(m, p / H, p % H, k1, k2) += 0.9 * row[k2] / sum;
      }
    m->n_prompts++;
  }
  free(row), free(pat);
  return KVP_OK;
}

/* ---- scores -------------------------------------------------------------- */

int kvp__mass_scas(const kvp__mass *m, uint32_t s, uint32_t t, uint32_t l, uint32_t h, double *out) {
  uint32_t K = m->n_scales;
  if (!m->n_prompts) return kvp__err(KVP_EINVAL, "attention mass: no prompt added");
  if (s > K - 1 || t < s || t + 1 >= K)
    return kvp__err(KVP_EINVAL, "S-CAS: 0-based source %u is not an ordered scale (sinks %u, scales %u)", t, s, K);
  double sum = 0; /* paper i = t + 1; tau = i+1..K is 0-based t+1..K-1 */
  for (uint32_t q = t + 1; q < K; q++) sum += *beta_at(m, l, h, q, t);
  *out = sum / (double)(K - 1 - t) / m->n_prompts;
  return KVP_OK;
}

int kvp__mass_cas(const kvp__mass *m, uint32_t s, uint32_t l, uint32_t h, double *out) {
  uint32_t K = m->n_scales;
  if (!m->n_prompts) return kvp__err(KVP_EINVAL, "attention mass: no prompt added");
  if (s > K - 1) return kvp__err(KVP_EINVAL, "CAS: %u sink scales of %u scales", s, K);
  double sum = 0; /* paper tau = s+1..K-1 is 0-based s..K-2; query scale K is K-1 */
  for (uint32_t t = s; t + 1 < K; t++) sum += *beta_at(m, l, h, K - 1, t);
  *out = sum / (double)(K - s) / m->n_prompts;
  return KVP_OK;
}

typedef struct scored {
  double score; /* S-CAS or CAS of the pair */
  uint32_t l;   /* layer */
  uint32_t h;   /* head */
} scored;

static int scored_cmp(const void *pa, const void *pb) {
  const scored *a = pa, *b = pb;
  if (a->score != b->score) return a->score < b->score ? -1 : 1;
  if (a->h != b->h) return a->h < b->h ? -1 : 1;
  return (a->l > b->l) - (a->l < b->l);
}

int kvp__orders_from_mass(kvp__orders *o, const kvp__mass *m, uint32_t s, bool cas, kvp__meta *meta) {
  memset(o, 0, sizeof *o);
  if (!m || !m->n_prompts) return kvp__err(KVP_EINVAL, "orders: no attention mass (no prompt added)");
  uint32_t L = m->n_layers, H = m->n_heads, K = m->n_scales, T = L * H;
  int rc = kvp__orders_alloc(o, L, H, K, s, meta);
  if (rc) return rc;
  o->cas = cas;
  scored *sc = malloc((size_t)T * sizeof *sc);
  if (!sc) {
    kvp__orders_free(o);
    return kvp__err(KVP_ENOMEM, "orders: scratch for %u pairs", T);
  }
  for (uint32_t j = 0; j < o->n_orders; j++) {
    if (!cas || j == 0) {
      for (uint32_t p = 0; p < T; p++) {
        sc[p] = (scored){0, p / H, p % H};
        if (cas) kvp__mass_cas(m, s, p / H, p % H, &sc[p].score);
        else kvp__mass_scas(m, s, s + j, p / H, p % H, &sc[p].score);
      }
      qsort(sc, T, sizeof *sc, scored_cmp);
    }
    for (uint32_t e = 0; e < T; e++) o->pairs[(size_t)j * T + e] = sc[e].l * H + sc[e].h;
  }
  free(sc);
  return KVP_OK;
}

int kvp__orders_synthetic(kvp__orders *o, uint32_t L, uint32_t H, uint32_t K, uint32_t s, uint64_t seed,
                          kvp__meta *meta) {
  return kvp__orders_synthetic_kind(o, L, H, K, s, seed, false, meta);
}

int kvp__orders_synthetic_kind(kvp__orders *o, uint32_t L, uint32_t H, uint32_t K, uint32_t s, uint64_t seed,
                               bool cas, kvp__meta *meta) {
  kvp__mass m;
  memset(o, 0, sizeof *o);
  int rc = kvp__mass_init(&m, L, H, K);
  if (!rc && s > K - 1) rc = kvp__err(KVP_EINVAL, "orders: %u scales with %u sink scales: need s <= K-1", K, s);
  if (!rc) rc = kvp__mass_synthetic(&m, s, seed, 1);
  if (!rc) rc = kvp__orders_from_mass(o, &m, s, cas, meta);
  kvp__mass_free(&m);
  return rc;
}
