/*
 * tests/unit/check_heatkv_calib.c - HeatKV calibration and its variants:
 * S-CAS (Eq. 4) and CAS (Eq. 3) from attention mass against sums written
 * out by hand, the orders' tie rule, the .npy and JSON summary readers and
 * their errors (nothing added on failure), the CAS order format, Binary-
 * HeatKV plans (whole heads, strict at every layer, greedy early pruning
 * minimal against a brute force as the paper's Proposition 1 says), the
 * pool's plan cache, and the kvpool-calib command line.
 */
#include "../../codecs/npy.h"
#include "../../pages/heatkv.h"
#include "../../pages/pages.h"
#include "../../pages/policy.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char tmpdir[64];

static void tmp_setup(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/kvp-calib-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}
static void tmp_teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
  ck_assert_int_eq(system(cmd), 0);
}
static const char *tmp_path(char *buf, size_t cap, const char *name) {
  snprintf(buf, cap, "%s/%s", tmpdir, name);
  return buf;
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

/* ---- scores by hand --------------------------------------------------------
 * L=1, H=3, K=4, s=1. beta[h][k1][k2] chosen so every sum is easy:
 *   S-CAS(h, t) = mean over q = t+1..3 of beta[h][q][t]   (t = 1, 2)
 *   CAS(h)      = (beta[h][3][1] + beta[h][3][2]) / (K - s = 3)            */

static double hand_beta(uint32_t h, uint32_t k1, uint32_t k2) {
  if (k2 > k1) return 0;
  static const double tab[3][4][4] = {
      {{1, 0, 0, 0}, {.5, .5, 0, 0}, {.2, .3, .5, 0}, {.1, .2, .3, .4}},
      {{1, 0, 0, 0}, {.4, .6, 0, 0}, {.1, .1, .8, 0}, {.1, .2, .1, .6}},
      {{1, 0, 0, 0}, {.9, .1, 0, 0}, {.6, .3, .1, 0}, {.5, .2, .3, 0}},
  };
  return tab[h][k1][k2];
}

START_TEST(scores_by_hand) {
  kvp__mass m;
  ck_ok(kvp__mass_init(&m, 1, 3, 4));
  for (uint32_t h = 0; h < 3; h++)
    for (uint32_t a = 0; a < 4; a++)
      for (uint32_t b = 0; b < 4; b++) m.beta[((size_t)h * 4 + a) * 4 + b] = 2 * hand_beta(h, a, b);
  m.n_prompts = 2; /* two identical prompts: the mean is the table */
  for (uint32_t h = 0; h < 3; h++) {
    double v, w;
    ck_ok(kvp__mass_scas(&m, 1, 1, 0, h, &v));
    w = (hand_beta(h, 2, 1) + hand_beta(h, 3, 1)) / 2;
    ck_assert_double_eq_tol(v, w, 1e-12);
    ck_ok(kvp__mass_scas(&m, 1, 2, 0, h, &v));
    ck_assert_double_eq_tol(v, hand_beta(h, 3, 2), 1e-12);
    ck_ok(kvp__mass_cas(&m, 1, 0, h, &v));
    ck_assert_double_eq_tol(v, (hand_beta(h, 3, 1) + hand_beta(h, 3, 2)) / 3, 1e-12);
  }
  /* source 0 is a sink, source 3 the never-cached last scale */
  double v;
  ck_status(kvp__mass_scas(&m, 1, 0, 0, 0, &v), KVP_EINVAL);
  ck_status(kvp__mass_scas(&m, 1, 3, 0, 0, &v), KVP_EINVAL);
  /* orders: S-CAS(1): h0 .25, h1 .15, h2 .25 -> 1, then 0 and 2 tied: head 0 first */
  kvp__orders o;
  ck_ok(kvp__orders_from_mass(&o, &m, 1, false, NULL));
  ck_assert_uint_eq(o.n_orders, 2);
  ck_assert_uint_eq(kvp__orders_pair(&o, 1, 0), 1);
  ck_assert_uint_eq(kvp__orders_pair(&o, 1, 1), 0);
  ck_assert_uint_eq(kvp__orders_pair(&o, 1, 2), 2);
  /* S-CAS(2): h0 .3, h1 .1, h2 .3 -> 1, 0, 2 */
  ck_assert_uint_eq(kvp__orders_pair(&o, 2, 0), 1);
  ck_assert_uint_eq(kvp__orders_pair(&o, 2, 1), 0);
  kvp__orders_free(&o);
  /* CAS: h0 .5/3, h1 .3/3, h2 .5/3 -> 1, 0, 2 in every list */
  ck_ok(kvp__orders_from_mass(&o, &m, 1, true, NULL));
  ck_assert(o.cas);
  for (uint32_t t = 1; t <= 2; t++) {
    ck_assert_uint_eq(kvp__orders_pair(&o, t, 0), 1);
    ck_assert_uint_eq(kvp__orders_pair(&o, t, 1), 0);
    ck_assert_uint_eq(kvp__orders_pair(&o, t, 2), 2);
  }
  kvp__orders_free(&o);
  kvp__mass_free(&m);
}
END_TEST

/* Ties across layers: equal scores order by head, then layer. */
START_TEST(tie_rule_head_then_layer) {
  kvp__mass m;
  ck_ok(kvp__mass_init(&m, 3, 2, 3));
  for (size_t i = 0; i < 3 * 2; i++) { /* every pair alike: only the tie rule orders */
    double *b = m.beta + i * 9;
    b[0] = 1, b[3] = .5, b[4] = .5, b[6] = .2, b[7] = .3, b[8] = .5;
  }
  m.n_prompts = 1;
  kvp__orders o;
  ck_ok(kvp__orders_from_mass(&o, &m, 1, false, NULL));
  static const uint32_t want[6][2] = {{0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1}, {2, 1}}; /* (layer, head) */
  for (uint32_t r = 0; r < 6; r++) ck_assert_uint_eq(kvp__orders_pair(&o, 1, r), want[r][0] * 2 + want[r][1]);
  kvp__orders_free(&o);
  kvp__mass_free(&m);
}
END_TEST

/* ---- summary files -------------------------------------------------------- */

/* A synthetic summary, averaged, written as .npy and as JSON. */
static void synth_mean(kvp__mass *m, uint32_t L, uint32_t H, uint32_t K, uint32_t prompts) {
  ck_ok(kvp__mass_init(m, L, H, K));
  ck_ok(kvp__mass_synthetic(m, 1, 9, prompts));
  for (size_t i = 0; i < (size_t)L * H * K * K; i++) m->beta[i] /= prompts;
  m->n_prompts = 1;
}

static void write_json_mass(const char *path, const kvp__mass *m) {
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "{\"beta\": [");
  uint32_t K = m->n_scales;
  for (uint32_t l = 0; l < m->n_layers; l++) {
    fprintf(f, "%s[", l ? "," : "");
    for (uint32_t h = 0; h < m->n_heads; h++) {
      fprintf(f, "%s[", h ? "," : "");
      for (uint32_t a = 0; a < K; a++) {
        fprintf(f, "%s[", a ? "," : "");
        for (uint32_t b = 0; b < K; b++)
          fprintf(f, "%s%.17g", b ? "," : "", m->beta[(((size_t)l * m->n_heads + h) * K + a) * K + b]);
        fprintf(f, "]");
      }
      fprintf(f, "]");
    }
    fprintf(f, "]");
  }
  fprintf(f, "]}\n");
  fclose(f);
}

START_TEST(summary_files_agree) {
  tmp_setup();
  kvp__mass src, a, b;
  synth_mean(&src, 2, 3, 5, 4);
  char pn[128], pj[128];
  uint64_t shape[4] = {2, 3, 5, 5};
  ck_ok(kvp__npy_write_f64(tmp_path(pn, sizeof pn, "m.npy"), 4, shape, src.beta));
  write_json_mass(tmp_path(pj, sizeof pj, "m.json"), &src);
  ck_ok(kvp__mass_init(&a, 2, 3, 5));
  ck_ok(kvp__mass_init(&b, 2, 3, 5));
  ck_ok(kvp__mass_add_file(&a, pn));
  ck_ok(kvp__mass_add_file(&b, pj));
  ck_ok(kvp__mass_add_file(&b, pj)); /* two prompts, the same: the mean does not move */
  ck_assert_uint_eq(a.n_prompts, 1);
  ck_assert_uint_eq(b.n_prompts, 2);
  for (uint32_t t = 1; t <= 3; t++)
    for (uint32_t p = 0; p < 6; p++) {
      double x, y, z;
      ck_ok(kvp__mass_scas(&src, 1, t, p / 3, p % 3, &x));
      ck_ok(kvp__mass_scas(&a, 1, t, p / 3, p % 3, &y));
      ck_ok(kvp__mass_scas(&b, 1, t, p / 3, p % 3, &z));
      ck_assert_double_eq_tol(x, y, 1e-15);
      ck_assert_double_eq_tol(x, z, 1e-15);
    }
  kvp__mass_free(&src), kvp__mass_free(&a), kvp__mass_free(&b);
  tmp_teardown();
}
END_TEST

/* A bad file names the culprit and adds nothing. */
static void bad_mass(const char *path, int want, const char *needle) {
  kvp__mass m;
  ck_ok(kvp__mass_init(&m, 2, 3, 5));
  ck_status(kvp__mass_add_file(&m, path), want);
  ck_assert_msg(strstr(kvp_last_error(), needle), "message \"%s\" lacks \"%s\"", kvp_last_error(), needle);
  ck_assert_uint_eq(m.n_prompts, 0);
  for (size_t i = 0; i < 2 * 3 * 5 * 5; i++) ck_assert(m.beta[i] == 0);
  kvp__mass_free(&m);
}

START_TEST(summary_files_refused) {
  tmp_setup();
  kvp__mass src;
  synth_mean(&src, 2, 3, 5, 1);
  char p[128];
  uint64_t shape[4] = {2, 3, 5, 5}, wrong[4] = {2, 3, 4, 4};
  /* a later scale attended to */
  src.beta[1] = 0.25;
  ck_ok(kvp__npy_write_f64(tmp_path(p, sizeof p, "upper.npy"), 4, shape, src.beta));
  bad_mass(p, KVP_EFORMAT, "beta[0][0][0][1]");
  src.beta[1] = 0;
  /* a negative mass, in the JSON reader */
  src.beta[(((size_t)1 * 3 + 2) * 5 + 3) * 5 + 2] = -0.5;
  write_json_mass(tmp_path(p, sizeof p, "neg.json"), &src);
  bad_mass(p, KVP_EFORMAT, "beta[1][2][3][2]");
  src.beta[(((size_t)1 * 3 + 2) * 5 + 3) * 5 + 2] = 0.1;
  /* a row above 1 */
  for (int k = 0; k < 5; k++) src.beta[(size_t)4 * 5 + k] = 0.5;
  ck_ok(kvp__npy_write_f64(tmp_path(p, sizeof p, "row.npy"), 4, shape, src.beta));
  bad_mass(p, KVP_EFORMAT, "sums to");
  /* wrong geometry */
  ck_ok(kvp__npy_write_f64(tmp_path(p, sizeof p, "shape.npy"), 4, wrong, src.beta));
  bad_mass(p, KVP_EFORMAT, "expected (2, 3, 5, 5)");
  /* no such file, unknown extension, broken JSON, wrong nesting */
  bad_mass(tmp_path(p, sizeof p, "absent.npy"), KVP_ENOENT, "absent.npy");
  write_text(tmp_path(p, sizeof p, "m.txt"), "1 2 3");
  bad_mass(p, KVP_EFORMAT, "expected a .npy or .json");
  write_text(tmp_path(p, sizeof p, "broken.json"), "{\"beta\": [[[");
  bad_mass(p, KVP_EFORMAT, "broken.json");
  write_text(tmp_path(p, sizeof p, "nest.json"), "{\"beta\": [[[[1, 0], [0.5, 0.5]]]]}");
  bad_mass(p, KVP_EFORMAT, "layers, expected 2");
  kvp__mass_free(&src);
  tmp_teardown();
}
END_TEST

/* ---- the .npy reader ------------------------------------------------------- */

/* A v1 header for descr/fortran/shape, padded to 64 bytes, then data. */
static size_t npy_bytes(unsigned char *buf, int major, const char *dict, const void *data, size_t dbytes) {
  size_t pre = major == 1 ? 10 : 12, n = strlen(dict), hl = ((pre + n + 1 + 63) / 64) * 64 - pre;
  memcpy(buf, "\x93NUMPY", 6);
  buf[6] = (unsigned char)major, buf[7] = 0;
  buf[8] = (unsigned char)(hl & 0xff), buf[9] = (unsigned char)(hl >> 8);
  if (major != 1) buf[10] = buf[11] = 0;
  memcpy(buf + pre, dict, n);
  memset(buf + pre + n, ' ', hl - n - 1);
  buf[pre + hl - 1] = '\n';
  memcpy(buf + pre + hl, data, dbytes);
  return pre + hl + dbytes;
}

START_TEST(npy_reader_edges) {
  unsigned char buf[512];
  kvp__npy a;
  float f[6] = {1, -2, 3.5f, 0, 1e-3f, 65504};
  size_t n = npy_bytes(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", f, sizeof f);
  ck_ok(kvp__npy_parse(&a, buf, n, "f4"));
  ck_assert_uint_eq(a.ndim, 2);
  ck_assert_uint_eq(a.shape[0], 2);
  ck_assert_uint_eq(a.shape[1], 3);
  ck_assert(kvp__npy_at(&a, 2) == 3.5);
  float back[6];
  kvp__npy_f32(&a, 0, 6, back);
  ck_assert(!memcmp(back, f, sizeof f));
  uint64_t want[2] = {2, 0};
  ck_ok(kvp__npy_expect(&a, "f4", 2, want));
  want[1] = 4;
  ck_status(kvp__npy_expect(&a, "f4", 2, want), KVP_EFORMAT);
  ck_assert(strstr(kvp_last_error(), "(2, 3)") && strstr(kvp_last_error(), "(2, 4)"));
  /* version 2, float16, keys in another order, 1-d shape "(3,)" */
  uint16_t h[3] = {0x3C00, 0xC000, 0x3800}; /* 1, -2, 0.5 */
  n = npy_bytes(buf, 2, "{'shape': (3,), 'fortran_order': False, 'descr': '<f2'}", h, sizeof h);
  ck_ok(kvp__npy_parse(&a, buf, n, "f2"));
  ck_assert_uint_eq(a.ndim, 1);
  ck_assert(kvp__npy_at(&a, 0) == 1 && kvp__npy_at(&a, 1) == -2 && kvp__npy_at(&a, 2) == 0.5);
  /* refusals, each naming what is wrong */
  static const struct {
    const char *dict;
    size_t cut; /* data bytes dropped (negative: see extra) */
    size_t extra;
    const char *needle;
  } bad[] = {
      {"{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", 0, 0, "'descr' '>f4'"},
      {"{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }", 0, 0, "'<i4'"},
      {"{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 0, 0, "fortran_order"},
      {"{'descr': '<f4', 'fortran_order': False, }", 0, 0, "'shape'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (), }", 0, 0, "scalar"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 4, 0, "truncated"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 0, 4, "trailing"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    float d[7] = {0};
    n = npy_bytes(buf, 1, bad[i].dict, d, sizeof f - bad[i].cut + bad[i].extra);
    ck_status(kvp__npy_parse(&a, buf, n, "bad.npy"), KVP_EFORMAT);
    ck_assert_msg(strstr(kvp_last_error(), bad[i].needle) && strstr(kvp_last_error(), "bad.npy"),
                  "case %zu: \"%s\" lacks \"%s\"", i, kvp_last_error(), bad[i].needle);
  }
  buf[0] = 'X';
  ck_status(kvp__npy_parse(&a, buf, n, "magic"), KVP_EFORMAT);
  ck_assert(strstr(kvp_last_error(), "magic"));
}
END_TEST

/* ---- CAS order files -------------------------------------------------------- */

/* A header that ends inside an unknown 'descr' value: the error message
 * quotes what is there and reads nothing past the header (the byte after it
 * is a PROT_NONE page here). */
START_TEST(npy_descr_at_the_end) {
  long pg = sysconf(_SC_PAGESIZE);
  unsigned char *map = mmap(NULL, 2 * (size_t)pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ck_assert(map != MAP_FAILED);
  ck_assert_int_eq(mprotect(map + pg, (size_t)pg, PROT_NONE), 0);
  static const char hdr[] = "{'descr': '<i";
  size_t hl = sizeof hdr - 1, n = 10 + hl;
  unsigned char *b = map + pg - n;
  memcpy(b, "\x93NUMPY\x01\x00", 8);
  b[8] = (unsigned char)hl, b[9] = 0;
  memcpy(b + 10, hdr, hl);
  kvp__npy a;
  ck_status(kvp__npy_parse(&a, b, n, "short.npy"), KVP_EFORMAT);
  ck_assert_msg(strstr(kvp_last_error(), "'descr' '<i:") != NULL, "%s", kvp_last_error());
  munmap(map, 2 * (size_t)pg);
}
END_TEST

/* A small kvpool-format file naming a large geometry but holding no lists
 * is refused before the loader allocates what the geometry would need
 * (here 499 lists x 1M pairs x 4 bytes = 2 GB). */
START_TEST(orders_small_file_large_geometry) {
  static const char *docs[] = {
      "{\"format\": \"" KVP__ORDERS_FORMAT "\", \"version\": 1, \"layers\": 1024, \"heads\": 1024, "
      "\"scales\": 500, \"sink_scales\": 0, \"pair\": [\"layer\", \"head\"], \"orders\": []}",
      "{\"format\": \"" KVP__ORDERS_FORMAT "\", \"version\": 1, \"layers\": 1024, \"heads\": 1024, "
      "\"scales\": 3, \"sink_scales\": 0, \"pair\": [\"layer\", \"head\"], \"orders\": [[[0, 0]], [[0, 0]]]}",
      "{\"format\": \"" KVP__ORDERS_FORMAT "\", \"version\": 1, \"kind\": \"cas\", \"layers\": 4096, "
      "\"heads\": 4096, \"scales\": 9, \"sink_scales\": 0, \"pair\": [\"layer\", \"head\"], \"orders\": [[]]}",
  };
  const char *want[] = {"0 lists, expected 499", "1 entries, expected L*H = 1048576", "0 entries"};
  for (size_t i = 0; i < sizeof docs / sizeof *docs; i++) {
    kvp__meta m = {0};
    kvp__orders o;
    ck_status(kvp__orders_parse(&o, docs[i], strlen(docs[i]), "big.json", KVP__ORDERS_ANY, KVP__ORDERS_ANY,
                                KVP__ORDERS_ANY, KVP__ORDERS_ANY, &m),
              KVP_EFORMAT);
    ck_assert_msg(strstr(kvp_last_error(), want[i]) != NULL, "%s", kvp_last_error());
    ck_assert_uint_lt(m.peak_bytes, 1u << 20);
    /* the shipped format: its list count is checked before the geometry's allocation */
    ck_status(kvp__orders_parse(&o, "[[], []]", 8, "shipped.json", 1024, 1024, 500, 0, &m), KVP_EFORMAT);
    ck_assert_uint_lt(m.peak_bytes, 1u << 20);
  }
}
END_TEST

START_TEST(cas_file_round_trip) {
  tmp_setup();
  kvp__orders o, back, scas;
  char p[128], q[128];
  ck_ok(kvp__orders_synthetic_kind(&o, 4, 3, 7, 2, 5, true, NULL));
  ck_assert(o.cas);
  ck_ok(kvp__orders_write(&o, tmp_path(p, sizeof p, "cas.json")));
  ck_ok(kvp__orders_load(&back, p, 4, 3, 7, 2, NULL));
  ck_assert(back.cas);
  ck_assert_uint_eq(back.n_orders, o.n_orders);
  ck_assert(!memcmp(back.pairs, o.pairs, (size_t)o.n_orders * 12 * sizeof *o.pairs));
  ck_assert_uint_eq(kvp__orders_checksum(&back), kvp__orders_checksum(&o));
  /* a CAS file for heatkv, or S-CAS orders for binary-heatkv: refused by the planner */
  static const uint32_t tok[7] = {1, 2, 4, 8, 16, 32, 64};
  kvp__heatkv_in in = {.n_layers = 4, .n_heads = 3, .n_scales = 7, .scale_tokens = tok, .n_sinks = 2, .b = 0.3,
                       .orders = &back};
  kvp__heatkv_plan plan;
  ck_status(kvp__heatkv_plan_build(&plan, &in, NULL), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "binary-heatkv"));
  ck_ok(kvp__orders_synthetic(&scas, 4, 3, 7, 2, 5, NULL));
  in.orders = &scas, in.binary = true;
  ck_status(kvp__heatkv_plan_build(&plan, &in, NULL), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "CAS"));
  /* the shipped format written by kvpool reads back as the same orders */
  ck_ok(kvp__orders_write_shipped(&scas, tmp_path(q, sizeof q, "shipped.json")));
  kvp__orders sh;
  ck_ok(kvp__orders_load(&sh, q, 4, 3, 7, 2, NULL));
  ck_assert_uint_eq(kvp__orders_checksum(&sh), kvp__orders_checksum(&scas));
  /* a corrupted CAS file: its checksum no longer matches */
  FILE *f = fopen(p, "r+");
  char text[8192];
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  char *sum = strstr(text, "fnv1a64:");
  ck_assert_ptr_nonnull(sum);
  sum[8] = sum[8] == '0' ? '1' : '0';
  rewind(f);
  fwrite(text, 1, n, f);
  fclose(f);
  kvp__orders bad;
  ck_status(kvp__orders_load(&bad, p, 4, 3, 7, 2, NULL), KVP_EFORMAT);
  ck_assert(strstr(kvp_last_error(), "checksum"));
  kvp__orders_free(&o), kvp__orders_free(&back), kvp__orders_free(&scas), kvp__orders_free(&sh);
  tmp_teardown();
}
END_TEST

/* ---- Binary-HeatKV plans -------------------------------------------------- */

static uint64_t rs = 0x5eed;
static uint32_t rnd(uint32_t n) { return (uint32_t)(t_rand(&rs) % n); }

/* A random CAS order in every list. */
static void random_cas(kvp__orders *o, uint32_t L, uint32_t H, uint32_t K, uint32_t s) {
  ck_ok(kvp__orders_alloc(o, L, H, K, s, NULL));
  o->cas = true;
  uint32_t T = L * H, perm[64];
  for (uint32_t i = 0; i < T; i++) perm[i] = i;
  for (uint32_t i = T; i > 1; i--) {
    uint32_t j = rnd(i), x = perm[i - 1];
    perm[i - 1] = perm[j], perm[j] = x;
  }
  for (uint32_t j = 0; j < o->n_orders; j++) memcpy(o->pairs + (size_t)j * T, perm, T * sizeof *perm);
}

typedef struct bstate {
  uint32_t L, H, K, s, T;
  const uint64_t *w;   /* [K][T] weights */
  uint8_t present[16 * 64];
} bstate;

static uint64_t occ_of(const bstate *S) {
  uint64_t o = 0;
  for (size_t a = 0; a < (size_t)S->K * S->T; a++) o += S->present[a] ? S->w[a] : 0;
  return o;
}

/* Replays a binary plan independently. Checks: occupancy <= floor(B) after
 * every layer; an early-pruned head loses every source before t at once;
 * at the end of every scale each head holds all its non-sink sources or
 * none. Then, per scale, the least number of whole heads that keeps every
 * checkpoint under B (brute force over the heads G_t adds) against the
 * plan's count. Returns the largest gap (plan - minimum). */
static uint32_t binary_check(const kvp__heatkv_in *in, const kvp__heatkv_plan *p, const uint64_t *w) {
  bstate S = {in->n_layers, in->n_heads, in->n_scales, in->n_sinks, in->n_layers * in->n_heads, w, {0}};
  uint32_t rank[64], gap = 0;
  for (uint32_t r = 0; r < S.T; r++) rank[kvp__orders_pair(in->orders, S.s, r)] = r;
  for (uint32_t t = 0; t < S.K; t++) {
    uint32_t prev = t ? p->n_prune[t - 1] : 0, now = p->n_prune[t];
    /* atom (i, pr) is in G_t: the last scale always; else an ordered source
     * i <= t of a head in the prefix of length N_t */
#define IN_G(i, pr) ((i) == S.K - 1 ? t == S.K - 1 : (i) >= S.s && (i) <= t && rank[pr] < now)
    /* the heads G_t adds, and what each weighs now (its sources < t) */
    uint32_t cand[64], nc = 0;
    uint64_t cw[64];
    for (uint32_t pr = 0; pr < S.T; pr++) {
      if (t < S.s || rank[pr] < prev || rank[pr] >= now) continue;
      cw[nc] = 0;
      for (uint32_t i = S.s; i < t; i++) cw[nc] += S.present[i * S.T + pr] ? w[i * S.T + pr] : 0;
      cand[nc++] = pr;
    }
    /* over[l]: occupancy over floor(B) after layer l with no early pruning */
    bstate X = S;
    int64_t over[16];
    for (uint32_t l = 0; l < S.L; l++) {
      for (uint32_t h = 0; h < S.H; h++) X.present[t * S.T + l * S.H + h] = 1;
      for (uint32_t h = 0; h < S.H; h++)
        for (uint32_t i = 0; i <= t; i++)
          if (IN_G(i, l * S.H + h)) X.present[i * S.T + l * S.H + h] = 0;
      over[l] = (int64_t)occ_of(&X) - (int64_t)p->budget_floor;
    }
#undef IN_G
    /* brute force: the least number m of whole heads covering over[] (a
     * head helps the checkpoints of layers below its own) */
    uint32_t m = 0;
    for (bool found = false; !found && m <= nc; m += !found) {
      for (uint64_t mask = 0; !found && mask < (1ull << nc); mask++) {
        if ((uint32_t)__builtin_popcountll(mask) != m) continue;
        bool ok = true;
        for (uint32_t l = 0; ok && l < S.L; l++) {
          int64_t o = over[l];
          for (uint32_t c = 0; c < nc; c++)
            if ((mask >> c & 1) && cand[c] / S.H > l) o -= (int64_t)cw[c];
          ok = o <= 0;
        }
        found = ok;
      }
    }
    /* the plan: its early atoms are whole heads */
    uint32_t ne, heads = 0;
    const kvp__heatkv_atom *e = kvp__heatkv_early(p, t, &ne);
    for (uint32_t i = 0; i < ne; i++) {
      uint32_t pr = e[i].layer * S.H + e[i].head;
      ck_assert_msg(S.present[e[i].scale * S.T + pr], "scale %u: early atom not present", t);
      S.present[e[i].scale * S.T + pr] = 0;
      if (i + 1 == ne || e[i + 1].layer != e[i].layer || e[i + 1].head != e[i].head) {
        heads++;
        for (uint32_t j = S.s; j < t; j++)
          ck_assert_msg(!S.present[j * S.T + pr], "scale %u: early head (%u, %u) keeps source %u", t, e[i].layer,
                        e[i].head, j);
      }
    }
    ck_assert_msg(m <= nc, "scale %u: no whole-head early set is feasible, yet the plan built", t);
    ck_assert_msg(heads >= m, "scale %u: plan %u heads below the brute-force minimum %u", t, heads, m);
    if (heads - m > gap) gap = heads - m;
    for (uint32_t l = 0; l < S.L; l++) {
      for (uint32_t h = 0; h < S.H; h++) S.present[t * S.T + l * S.H + h] = 1;
      uint32_t nd;
      const kvp__heatkv_atom *d = kvp__heatkv_drops(p, t, l, &nd);
      for (uint32_t i = 0; i < nd; i++) S.present[d[i].scale * S.T + d[i].layer * S.H + d[i].head] = 0;
      ck_assert_msg(occ_of(&S) <= p->budget_floor, "scale %u layer %u: %llu > %llu", t, l,
                    (unsigned long long)occ_of(&S), (unsigned long long)p->budget_floor);
    }
    for (uint32_t pr = 0; t + 1 < S.K && pr < S.T; pr++) { /* whole heads at the end of the scale */
      uint32_t have = 0;
      for (uint32_t i = S.s; i <= t; i++) have += S.present[i * S.T + pr];
      ck_assert_msg(have == 0 || have == (t >= S.s ? t - S.s + 1 : 0), "scale %u: pair %u holds %u of its sources",
                    t, pr, have);
    }
  }
  return gap;
}

START_TEST(binary_whole_heads_and_minimal) {
  int runs = 0, gaps = 0;
  for (int it = 0; it < 3000; it++) {
    uint32_t L = 2 + rnd(3), H = 2 + rnd(2), K = 4 + rnd(3), s = 1;
    uint32_t tok[8];
    for (uint32_t t = 0; t < K; t++) tok[t] = t ? tok[t - 1] + 1 + rnd(30) : 1 + rnd(4);
    kvp__orders o;
    random_cas(&o, L, H, K, s);
    uint64_t w[8 * 64];
    for (uint32_t t = 0; t < K; t++)
      for (uint32_t p = 0; p < L * H; p++) w[t * L * H + p] = tok[t];
    uint64_t c_s = tok[0], full = 0;
    for (uint32_t t = 0; t + 1 < K; t++) full += tok[t];
    double bmin = (double)c_s / (double)full, b = bmin + (1 - bmin) * (0.05 + 0.9 * (rnd(1000) / 1000.0));
    kvp__heatkv_in in = {.n_layers = L, .n_heads = H, .n_scales = K, .scale_tokens = tok, .n_sinks = s, .b = b,
                         .orders = &o, .binary = true};
    kvp__heatkv_plan p;
    int rc = kvp__heatkv_plan_build(&p, &in, NULL);
    if (rc == KVP_OK) {
      runs++;
      gaps += binary_check(&in, &p, w) != 0;
      kvp__heatkv_plan_free(&p);
    } else {
      ck_assert_int_eq(rc, KVP_EINVAL); /* whole heads can run out of candidates */
      ck_assert(strstr(kvp_last_error(), "no early-pruning candidate"));
    }
    kvp__orders_free(&o);
  }
  printf("binary-heatkv: %d random plans, greedy whole-head early pruning minimal in all but %d\n", runs, gaps);
  ck_assert_int_gt(runs, 1000);
  ck_assert_int_eq(gaps, 0); /* Proposition 1: equal head weights, the greedy is minimal */
}
END_TEST

/* Binary plans for Infinity-2B under synthetic CAS orders: strict at b = 0.2,
 * 0.1, 0.04, and N as Eq. 5. */
START_TEST(binary_infinity_2b) {
  static const uint32_t tok[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};
  static const double bs[3] = {0.2, 0.1, 0.04};
  kvp__orders o;
  ck_ok(kvp__orders_synthetic_kind(&o, 32, 16, 13, 3, 1, true, NULL));
  for (int i = 0; i < 3; i++) {
    kvp__heatkv_in in = {.n_layers = 32, .n_heads = 16, .n_scales = 13, .scale_tokens = tok, .n_sinks = 3,
                         .b = bs[i], .orders = &o, .binary = true};
    kvp__heatkv_plan p;
    ck_ok(kvp__heatkv_plan_build(&p, &in, NULL));
    uint64_t c = 0, c_last = 6425;
    for (uint32_t t = 0; t + 1 < 13; t++) {
      c += tok[t];
      ck_assert_uint_eq(p.n_prune[t], kvp__heatkv_eq5(512, c, 21, c_last, bs[i], t + 1, 3));
      ck_assert_uint_le(p.max_occupancy[t], p.budget_floor);
    }
    printf("binary-heatkv Infinity-2B b=%.2f: pooled peak %llu of %.0f slots (%.2f%%)\n", bs[i],
           (unsigned long long)p.pooled_peak, p.budget, 100.0 * p.pooled_peak / p.budget);
    kvp__heatkv_plan_free(&p);
  }
  kvp__orders_free(&o);
}
END_TEST

/* ---- the pool's plan cache ------------------------------------------------- */

START_TEST(plans_cached_across_sequences) {
  static const uint32_t tok[6] = {1, 4, 9, 16, 25, 36};
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 4, c.n_kv_heads = 2, c.head_dim = 16, c.region_bytes = 8u << 20;
  c.policy = "heatkv:b=0.3:s=1:orders=synthetic";
  kvp_pool *pool;
  ck_ok(kvp_pool_create(&c, &pool));
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP, sc.n_steps = 6, sc.step_tokens = tok;
  for (uint64_t id = 1; id <= 20; id++) ck_ok(kvp_seq_add(pool, id, &sc));
  uint64_t builds, hits;
  kvp__heatkv_cache_counts(pool, &builds, &hits);
  ck_assert_uint_eq(builds, 1);
  ck_assert_uint_eq(hits, 19);
  sc.budget_fraction = 0.5; /* another b: another plan */
  ck_ok(kvp_seq_add(pool, 21, &sc));
  sc.policy = "binary-heatkv:b=0.3:s=1:scores=synthetic";
  sc.budget_fraction = 0;
  ck_ok(kvp_seq_add(pool, 22, &sc));
  ck_ok(kvp_seq_add(pool, 23, &sc));
  kvp__heatkv_cache_counts(pool, &builds, &hits);
  ck_assert_uint_eq(builds, 3);
  ck_assert_uint_eq(hits, 20);
  uint64_t meta_before = pool->meta.bytes;
  for (uint64_t id = 1; id <= 23; id++) ck_ok(kvp_seq_free(pool, id));
  ck_pool(pool);
  ck_assert_uint_le(pool->meta.bytes, meta_before); /* cached plans kept, nothing grows */
  /* an infeasible budget fails and leaves the cache as it was */
  sc.policy = NULL, sc.budget_fraction = 0.001;
  ck_status(kvp_seq_add(pool, 30, &sc), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "smallest feasible"));
  kvp__heatkv_cache_counts(pool, &builds, &hits);
  ck_assert_uint_eq(builds, 3);
  ck_pool(pool);
  kvp_pool_destroy(pool);
}
END_TEST

/* ---- kvpool-calib ------------------------------------------------------------
 * The binary sits next to the tests' folder (build/kvpool-calib). */

static int run_calib(const char *args, char *out, size_t cap) { return t_run_tool("kvpool-calib", args, out, cap); }

START_TEST(calib_cli) {
  tmp_setup();
  static char out[1 << 16];
  char args[512];
  /* orders from a synthetic calibration, all three files, loadable */
  snprintf(args, sizeof args, "heatkv --synthetic --preset infinity-2b --prompts 3 --out %s/c --json", tmpdir);
  ck_assert_int_eq(run_calib(args, out, sizeof out), 0);
  ck_assert_msg(strstr(out, "\"prompts\": 3") && strstr(out, "\"scas\""), "%s", out);
  char p[128];
  kvp__orders o;
  ck_ok(kvp__orders_load(&o, tmp_path(p, sizeof p, "c.orders.json"), 32, 16, 13, 3, NULL));
  kvp__orders_free(&o);
  ck_ok(kvp__orders_load(&o, tmp_path(p, sizeof p, "c.kvpool.json"), KVP__ORDERS_ANY, KVP__ORDERS_ANY,
                         KVP__ORDERS_ANY, KVP__ORDERS_ANY, NULL));
  ck_assert(!o.cas && o.n_layers == 32 && o.n_heads == 16);
  kvp__orders_free(&o);
  ck_ok(kvp__orders_load(&o, tmp_path(p, sizeof p, "c.cas.json"), 32, 16, 13, 3, NULL));
  ck_assert(o.cas);
  kvp__orders_free(&o);
  /* a plan from those orders: JSON keys, N by Eq. 5 */
  snprintf(args, sizeof args, "plan --orders %s/c.kvpool.json --preset infinity-2b --b 0.1 --sinks 3 --json", tmpdir);
  ck_assert_int_eq(run_calib(args, out, sizeof out), 0);
  ck_assert_msg(strstr(out, "\"prune_counts\":[0,0,0,0,0,0,0,159,297,385,435,463,463]"), "%s", out);
  ck_assert(strstr(out, "\"early_counts\"") && strstr(out, "\"max_occupancy\"") && strstr(out, "\"budget\":328960"));
  snprintf(args, sizeof args, "plan --binary --orders %s/c.cas.json --preset infinity-2b --b 0.04", tmpdir);
  ck_assert_int_eq(run_calib(args, out, sizeof out), 0);
  ck_assert_msg(strstr(out, "binary-heatkv plan"), "%s", out);
  ck_assert_int_eq(run_calib("plan --layers 2 --heads 2 --schedule 1,2,3,4 --sinks 1 --b 0.5 --bytes "
                             "--codecs k=int8,v=int8 --head-dim 64", out, sizeof out), 0);
  ck_assert_msg(strstr(out, "bytes"), "%s", out);
  /* codecs with token groups or per-block side data plan at the pool's default block sizes */
  ck_assert_int_eq(run_calib("plan --layers 2 --heads 2 --schedule 1,4,16,64 --sinks 1 --b 0.5 --bytes "
                             "--codecs kv=kivi:bits=2:group=32", out, sizeof out), 0);
  ck_assert_int_eq(run_calib("plan --layers 2 --heads 2 --schedule 1,4,16,64 --sinks 1 --b 0.5 --bytes "
                             "--codecs kv=qvg", out, sizeof out), 0);
  /* ... and an explicit size that conflicts is named */
  ck_assert_int_eq(run_calib("plan --layers 2 --heads 2 --schedule 1,4,16,64 --sinks 1 --b 0.5 --bytes "
                             "--codecs kv=kivi:bits=2:group=32 --block-tokens 16", out, sizeof out), 1);
  ck_assert_msg(strstr(out, "block_tokens = 16") && strstr(out, "kivi"), "%s", out);
  /* an unwritable --out prefix fails before the work */
  ck_assert_int_eq(run_calib("heatkv --synthetic --preset infinity-2b --out /nonexistent/dir/c", out, sizeof out), 1);
  ck_assert_msg(strstr(out, "cannot write /nonexistent/dir/c.orders.json"), "%s", out);
  /* bad input: named, non-zero */
  ck_assert_int_eq(run_calib("plan --preset infinity-2b --b 0.001", out, sizeof out), 1);
  ck_assert_msg(strstr(out, "smallest feasible budget"), "%s", out);
  ck_assert_int_eq(run_calib("plan --preset nope --b 0.1", out, sizeof out), 2);
  ck_assert(strstr(out, "--preset nope"));
  ck_assert_int_eq(run_calib("plan --preset infinity-2b --b 0.1 --orders /nonexistent.json", out, sizeof out), 1);
  ck_assert(strstr(out, "/nonexistent.json"));
  snprintf(args, sizeof args, "plan --preset infinity-2b --b 0.1 --orders %s/c.cas.json", tmpdir);
  ck_assert_int_eq(run_calib(args, out, sizeof out), 1);
  ck_assert(strstr(out, "binary-heatkv"));
  snprintf(args, sizeof args, "heatkv --preset infinity-2b --mass %s/none.npy --out %s/x", tmpdir, tmpdir);
  ck_assert_int_eq(run_calib(args, out, sizeof out), 1);
  ck_assert(strstr(out, "none.npy"));
  ck_assert_int_eq(run_calib("heatkv --synthetic --preset infinity-2b", out, sizeof out), 2);
  ck_assert(strstr(out, "--out"));
  ck_assert_int_eq(run_calib("frobnicate", out, sizeof out), 2);
  ck_assert_int_eq(run_calib("--help", out, sizeof out), 0);
  ck_assert(strstr(out, "heatkv") && strstr(out, "plan"));
  tmp_teardown();
}
END_TEST

int main(void) {
  Suite *s = suite_create("heatkv_calib");
  TCase *tc = tcase_create("calib");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, scores_by_hand);
  tcase_add_test(tc, tie_rule_head_then_layer);
  tcase_add_test(tc, summary_files_agree);
  tcase_add_test(tc, summary_files_refused);
  tcase_add_test(tc, npy_reader_edges);
  tcase_add_test(tc, npy_descr_at_the_end);
  tcase_add_test(tc, orders_small_file_large_geometry);
  tcase_add_test(tc, cas_file_round_trip);
  tcase_add_test(tc, binary_whole_heads_and_minimal);
  tcase_add_test(tc, binary_infinity_2b);
  tcase_add_test(tc, plans_cached_across_sequences);
  tcase_add_test(tc, calib_cli);
  suite_add_tcase(s, tc);
  return t_run(s);
}
