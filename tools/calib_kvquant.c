/*
 * tools/calib_kvquant.c - `kvpool-calib kvquant`: the calibration file of
 * the kvquant codec (format in codecs/kvquant_calib.c) from K and V
 * samples, or from the built-in synthetic generator.
 *
 *   --k FILE --v FILE    .npy [tokens, L, H, D] ('<f4', '<f2' or '<f8', C
 *                        order), the keys as the pool will receive them
 *                        (before RoPE for prerope=1) and the values
 *   --fisher-k/-v FILE   optional .npy of the same shape: weights (>= 0,
 *                        e.g. squared gradients) of the codebook fit
 *   --synthetic          samples from the generator: --seqs N sequences of
 *                        --tokens T tokens for --layers/--heads/--head-dim
 * The fit itself is the library's (kvp_kvquant_calib_*): per-channel
 * percentile thresholds (outliers excluded) and a weighted k-means
 * codebook per layer and side.
 */
#include "calib.h"

#include "../codecs/npy.h"
#include "kvpool_codec.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void kvquant_usage(FILE *f) {
  fprintf(f,
          "usage: kvpool-calib kvquant (--k FILE --v FILE [--fisher-k FILE --fisher-v FILE] |\n"
          "                             --synthetic --layers L --heads H --head-dim D [--seqs N] [--tokens T] [--seed N])\n"
          "                            [--bits B] [--outliers F] --out FILE [--json]\n\n"
          "Fits the kvquant codec's calibration: per (layer, head, channel) the offset and half-range of the\n"
          "percentile thresholds [F/2, 1 - F/2] (K: normalization; V: outlier ranking), and per layer and side\n"
          "a 2^B-entry non-uniform codebook by k-means, weighted by Fisher information when given. Writes a\n"
          "versioned binary file with a CRC-32 for kv=kvquant:bits=B:calib=FILE.\n\n"
          "  --k, --v FILE   samples: .npy [tokens, L, H, D] ('<f4', '<f2', '<f8'); keys as the pool receives them\n"
          "  --fisher-k, --fisher-v FILE   weights of the codebook fit, the same shape (default 1)\n"
          "  --synthetic     the built-in generator (outlier channels, heavy tails); --seqs N (16), --tokens T\n"
          "                  (2048), --seed N (0), and the geometry --layers, --heads, --head-dim\n"
          "  --bits B        2, 3 or 4 (default 3)          --outliers F   fraction in [0, 0.5) (default 0.01)\n"
          "  --out FILE      the calibration file           --json         one JSON object on stdout\n");
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Open a sample file and check it is [T, L, H, D] (like ref when given). */
static int open_samples(kvp__npy *a, const char *path, const kvp__npy *ref) {
  if (kvp__npy_open(a, path)) return calib_fail(1, "kvquant", "%s", kvp_last_error());
  uint64_t dims[4] = {0, 0, 0, 0};
  if (ref) memcpy(dims, ref->shape, sizeof dims);
  if (kvp__npy_expect(a, path, 4, dims)) {
    kvp__npy_close(a);
    return calib_fail(1, "kvquant", "%s", kvp_last_error());
  }
  for (int i = 0; i < 4; i++)
    if (a->shape[i] == 0 || (i && a->shape[i] > 65536) || (i == 0 && a->shape[i] > UINT32_MAX)) {
      kvp__npy_close(a);
      return calib_fail(1, "kvquant", "%s: shape dimension %d = %llu out of range", path, i,
                        (unsigned long long)a->shape[i]);
    }
  return 0;
}

/* Rows of (layer l, head h) of a [T, L, H, D] array into x (T x D). */
static void gather(const kvp__npy *a, uint32_t l, uint32_t h, float *x) {
  uint64_t T = a->shape[0], L = a->shape[1], H = a->shape[2], D = a->shape[3];
  for (uint64_t t = 0; t < T; t++) kvp__npy_f32(a, ((t * L + l) * H + h) * D, D, x + t * D);
}

static int fit_files(kvp_kvquant_calib *c, const char *const *paths, int json) {
  int progress = !json && isatty(2); /* a bar redrawn in place: on a terminal only */
  kvp__npy a[4] = {{0}};
  int rc = 0;
  for (int i = 0; i < 4 && !rc; i++)
    if (paths[i]) rc = open_samples(&a[i], paths[i], i ? &a[0] : NULL);
  uint64_t T = a[0].shape[0], L = a[0].shape[1], H = a[0].shape[2], D = a[0].shape[3];
  float *x = rc ? NULL : malloc(T * D * sizeof *x), *w = rc ? NULL : malloc(T * D * sizeof *w);
  if (!rc && (!x || !w)) rc = calib_fail(1, "kvquant", "out of memory for %llu sample rows", (unsigned long long)T);
  for (uint32_t l = 0; !rc && l < L; l++) {
    for (uint32_t h = 0; !rc && h < H; h++)
      for (uint32_t kv = 0; !rc && kv < 2; kv++) {
        gather(&a[kv], l, h, x);
        if (paths[2 + kv]) gather(&a[2 + kv], l, h, w);
        if (kvp_kvquant_calib_add(c, l, h, kv, x, paths[2 + kv] ? w : NULL, D, (uint32_t)T)) {
          /* a weight's fault is the Fisher file's, a sample's the K or V file's */
          const char *culprit = paths[2 + kv] && strstr(kvp_last_error(), "weight") ? paths[2 + kv] : paths[kv];
          rc = calib_fail(1, "kvquant", "%s: layer %u %c: %s", culprit, l, "KV"[kv], kvp_last_error());
        }
      }
    if (progress && !rc) fprintf(stderr, "\rkvpool-calib kvquant: layer %u/%llu fitted", l + 1, (unsigned long long)L);
  }
  if (progress) fputc('\n', stderr);
  free(x);
  free(w);
  for (int i = 0; i < 4; i++) kvp__npy_close(&a[i]);
  return rc;
}

int kvp_calib_kvquant_main(int argc, char **argv) {
  static const struct option opts[] = {
      {"k", required_argument, 0, 'k'},        {"v", required_argument, 0, 'v'},
      {"fisher-k", required_argument, 0, 'K'}, {"fisher-v", required_argument, 0, 'V'},
      {"synthetic", no_argument, 0, 'y'},      {"layers", required_argument, 0, 'L'},
      {"heads", required_argument, 0, 'H'},    {"head-dim", required_argument, 0, 'D'},
      {"seqs", required_argument, 0, 'S'},     {"tokens", required_argument, 0, 'T'},
      {"seed", required_argument, 0, 's'},     {"bits", required_argument, 0, 'b'},
      {"outliers", required_argument, 0, 'o'}, {"out", required_argument, 0, 'O'},
      {"json", no_argument, 0, 'j'},           {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  const char *paths[4] = {0}, *out = NULL;
  uint32_t L = 0, H = 0, D = 0, seqs = 16, tokens = 2048, seed = 0, bits = 3;
  double fraction = 0.01;
  int synthetic = 0, json = 0, c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
    case 'k': paths[0] = optarg; break;
    case 'v': paths[1] = optarg; break;
    case 'K': paths[2] = optarg; break;
    case 'V': paths[3] = optarg; break;
    case 'y': synthetic = 1; break;
    case 'L': if (calib_u32("--layers", optarg, 1, 4096, &L)) return 2; break;
    case 'H': if (calib_u32("--heads", optarg, 1, 1024, &H)) return 2; break;
    case 'D': if (calib_u32("--head-dim", optarg, 1, 4096, &D)) return 2; break;
    case 'S': if (calib_u32("--seqs", optarg, 1, 1u << 16, &seqs)) return 2; break;
    case 'T': if (calib_u32("--tokens", optarg, 1, 1u << 24, &tokens)) return 2; break;
    case 's': if (calib_u32("--seed", optarg, 0, UINT32_MAX, &seed)) return 2; break;
    case 'b': if (calib_u32("--bits", optarg, 2, 4, &bits)) return 2; break;
    case 'o': {
      char *e;
      fraction = strtod(optarg, &e);
      if (*e || !(fraction >= 0 && fraction < 0.5)) return calib_fail(2, "kvquant", "--outliers %s: want [0, 0.5)", optarg);
      break;
    }
    case 'O': out = optarg; break;
    case 'j': json = 1; break;
    case 'h': kvquant_usage(stdout); return 0;
    default: kvquant_usage(stderr); return 2;
    }
  }
  if (!out) return calib_fail(2, "kvquant", "--out FILE is required");
  if (calib_out_ok("kvquant", out)) return 1;
  if (synthetic == (paths[0] != NULL) || (!synthetic && !paths[1]) || (!paths[2] != !paths[3]))
    return calib_fail(2, "kvquant", "give --k and --v (and both --fisher-k and --fisher-v, or neither), or --synthetic");
  if (synthetic && (!L || !H || !D)) return calib_fail(2, "kvquant", "--synthetic needs --layers, --heads and --head-dim");
  if (synthetic && (uint64_t)seqs * tokens > UINT32_MAX) return calib_fail(2, "kvquant", "--seqs x --tokens too large");
  if (!synthetic) { /* the geometry comes from the sample file */
    kvp__npy a = {0};
    if (open_samples(&a, paths[0], NULL)) return 1;
    L = (uint32_t)a.shape[1], H = (uint32_t)a.shape[2], D = (uint32_t)a.shape[3];
    kvp__npy_close(&a);
  }
  kvp_kvquant_calib *cal;
  if (kvp_kvquant_calib_create(L, H, D, bits, fraction, &cal)) return calib_fail(1, "kvquant", "%s", kvp_last_error());
  double t0 = now_s();
  int rc = 0;
  if (synthetic) {
    if (!json) fprintf(stderr, "kvpool-calib kvquant: fitting %u layers x %u heads x 2 sides on %u x %u synthetic tokens\n",
                       L, H, seqs, tokens);
    if (kvp_kvquant_calib_synthetic(cal, seed, seqs, tokens)) rc = calib_fail(1, "kvquant", "%s", kvp_last_error());
  } else {
    rc = fit_files(cal, paths, json);
  }
  double fit_s = now_s() - t0;
  if (!rc && kvp_kvquant_calib_write(cal, out)) rc = calib_fail(1, "kvquant", "%s", kvp_last_error());
  double all_s = now_s() - t0;
  kvp_kvquant_calib_destroy(cal);
  if (rc) return rc;
  uint64_t file_bytes = 40 + (uint64_t)L * 2 * (2ull * H * D + (1u << bits)) * 4 + 4;
  if (json)
    printf("{\"out\": \"%s\", \"layers\": %u, \"heads\": %u, \"head_dim\": %u, \"bits\": %u, \"outliers\": %g, "
           "\"source\": \"%s\", \"bytes\": %llu, \"fit_seconds\": %.3f, \"seconds\": %.3f}\n",
           out, L, H, D, bits, fraction, synthetic ? "synthetic" : "npy", (unsigned long long)file_bytes, fit_s, all_s);
  else
    printf("kvquant calibration: L=%u H=%u D=%u bits=%u outliers=%g -> %s (%llu bytes) in %.2f s\n", L, H, D, bits,
           fraction, out, (unsigned long long)file_bytes, all_s);
  return 0;
}
