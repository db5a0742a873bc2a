/*
 * codecs/npy.c - the .npy reader (codecs/npy.h).
 *
 * Layout of a .npy file: the magic "\x93NUMPY", major and minor version
 * bytes, the header length (u16 LE for 1.x, u32 LE for 2.x and 3.x), the
 * header (a Python dict literal with the keys 'descr', 'fortran_order' and
 * 'shape', padded with spaces and ended by '\n'), then the data. The parser
 * reads the three keys in any order and refuses anything else it does not
 * understand rather than guess.
 */
#include "npy.h"

#include "numeric.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const unsigned char MAGIC[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

/* The value text after 'key': in header h (n bytes), or NULL. */
static const char *field(const char *h, size_t n, const char *key) {
  size_t kl = strlen(key);
  for (size_t i = 0; i + kl + 2 < n; i++) {
    if ((h[i] != '\'' && h[i] != '"') || memcmp(h + i + 1, key, kl) || h[i + 1 + kl] != h[i]) continue;
    const char *p = h + i + kl + 2;
    while (p < h + n && (*p == ' ' || *p == ':')) p++;
    return p < h + n ? p : NULL;
  }
  return NULL;
}

static int parse_descr(kvp__npy *a, const char *h, size_t n, const char *name) {
  const char *v = field(h, n, "descr");
  if (!v) return kvp__err(KVP_EFORMAT, "%s: npy header has no 'descr'", name);
  static const struct {
    const char *s;
    kvp__npy_dtype t;
  } ok[] = {{"'<f4'", KVP__NPY_F32}, {"'<f8'", KVP__NPY_F64}, {"'<f2'", KVP__NPY_F16}};
  for (size_t i = 0; i < KVP__ARRAY_LEN(ok); i++)
    if ((size_t)(h + n - v) >= 5 && !memcmp(v, ok[i].s, 5)) return a->dtype = ok[i].t, KVP_OK;
  size_t left = (size_t)(h + n - v), show = left < 8 ? left : 8; /* never past the header */
  const char *e = memchr(v, ',', left);
  return kvp__err(KVP_EFORMAT, "%s: npy 'descr' %.*s: expected '<f4', '<f8' or '<f2' (little-endian float)", name,
                  (int)(e ? (size_t)(e - v) : show), v);
}

static int parse_order(const char *h, size_t n, const char *name) {
  const char *v = field(h, n, "fortran_order");
  if (!v) return kvp__err(KVP_EFORMAT, "%s: npy header has no 'fortran_order'", name);
  if ((size_t)(h + n - v) >= 5 && !memcmp(v, "False", 5)) return KVP_OK;
  return kvp__err(KVP_EFORMAT, "%s: npy 'fortran_order' is not False: only C-order arrays are read", name);
}

static int parse_shape(kvp__npy *a, const char *h, size_t n, const char *name) {
  const char *v = field(h, n, "shape"), *end = h + n;
  if (!v || *v != '(') return kvp__err(KVP_EFORMAT, "%s: npy header has no 'shape' tuple", name);
  v++;
  a->count = 1;
  for (;;) {
    while (v < end && *v == ' ') v++;
    if (v < end && *v == ')') break;
    if (v >= end || *v < '0' || *v > '9')
      return kvp__err(KVP_EFORMAT, "%s: npy 'shape': dimension %u is not a number", name, a->ndim);
    if (a->ndim == KVP__NPY_MAX_DIMS)
      return kvp__err(KVP_EFORMAT, "%s: npy 'shape': more than %d dimensions", name, KVP__NPY_MAX_DIMS);
    uint64_t d = 0;
    while (v < end && *v >= '0' && *v <= '9') {
      if (d > (UINT64_MAX - 9) / 10) return kvp__err(KVP_EFORMAT, "%s: npy 'shape': dimension overflows", name);
      d = d * 10 + (uint64_t)(*v++ - '0');
    }
    if (d && a->count > UINT64_MAX / d) return kvp__err(KVP_EFORMAT, "%s: npy 'shape': too many elements", name);
    a->shape[a->ndim++] = d;
    a->count *= d;
    while (v < end && (*v == ' ' || *v == 'L')) v++;
    if (v < end && *v == ',') v++;
  }
  if (a->ndim == 0) return kvp__err(KVP_EFORMAT, "%s: npy 'shape' is () (a scalar): an array is expected", name);
  return KVP_OK;
}

int kvp__npy_parse(kvp__npy *a, const void *buf, size_t len, const char *name) {
  const unsigned char *b = buf;
  memset(a, 0, sizeof *a);
  if (len < 10 || memcmp(b, MAGIC, sizeof MAGIC))
    return kvp__err(KVP_EFORMAT, "%s: not a .npy file (bad magic)", name);
  if (b[6] < 1 || b[6] > 3) return kvp__err(KVP_EFORMAT, "%s: npy version %u.%u unknown", name, b[6], b[7]);
  size_t hl, off;
  if (b[6] == 1) hl = (size_t)b[8] | (size_t)b[9] << 8, off = 10;
  else {
    if (len < 12) return kvp__err(KVP_EFORMAT, "%s: npy header truncated", name);
    hl = (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24, off = 12;
  }
  if (hl > len - off) return kvp__err(KVP_EFORMAT, "%s: npy header of %zu bytes passes the end of the file", name, hl);
  const char *h = (const char *)b + off;
  int rc;
  if ((rc = parse_descr(a, h, hl, name)) || (rc = parse_order(h, hl, name)) || (rc = parse_shape(a, h, hl, name))) {
    memset(a, 0, sizeof *a);
    return rc;
  }
  size_t have = len - off - hl;
  uint64_t need = a->count * (uint64_t)a->dtype;
  if (a->count > UINT64_MAX / a->dtype || need != have) {
    int err = kvp__err(KVP_EFORMAT, "%s: npy data is %zu bytes, the shape needs %llu (%s)", name, have,
                       (unsigned long long)need, need > have ? "truncated" : "trailing bytes");
    memset(a, 0, sizeof *a);
    return err;
  }
  a->data = b + off + hl;
  return KVP_OK;
}

int kvp__npy_open(kvp__npy *a, const char *path) {
  memset(a, 0, sizeof *a);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return kvp__err(KVP_ENOENT, "%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) || st.st_size <= 0) {
    close(fd);
    return kvp__err(KVP_EFORMAT, "%s: empty or unreadable file", path);
  }
  void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return kvp__err(KVP_ENOENT, "%s: cannot map: %s", path, strerror(errno));
  int rc = kvp__npy_parse(a, m, (size_t)st.st_size, path);
  if (rc) {
    munmap(m, (size_t)st.st_size);
    return rc;
  }
  a->map = m, a->map_bytes = (size_t)st.st_size;
  return KVP_OK;
}

void kvp__npy_close(kvp__npy *a) {
  if (a->map) munmap(a->map, a->map_bytes);
  memset(a, 0, sizeof *a);
}

double kvp__npy_at(const kvp__npy *a, uint64_t i) {
  const unsigned char *p = a->data + i * a->dtype;
  if (a->dtype == KVP__NPY_F64) {
    double d;
    memcpy(&d, p, sizeof d);
    return d;
  }
  if (a->dtype == KVP__NPY_F32) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
  }
  return kvp__f16_to_f32((uint16_t)(p[0] | p[1] << 8));
}

void kvp__npy_f32(const kvp__npy *a, uint64_t i0, uint64_t n, float *out) {
  if (a->dtype == KVP__NPY_F32) {
    memcpy(out, a->data + i0 * 4, n * 4);
    return;
  }
  for (uint64_t i = 0; i < n; i++) out[i] = (float)kvp__npy_at(a, i0 + i);
}

int kvp__npy_expect(const kvp__npy *a, const char *name, uint32_t ndim, const uint64_t *dims) {
  bool ok = a->ndim == ndim;
  for (uint32_t i = 0; ok && i < ndim; i++) ok = !dims[i] || dims[i] == a->shape[i];
  if (ok) return KVP_OK;
  char want[160], got[160];
  size_t w = 0, g = 0;
  for (uint32_t i = 0; i < ndim && w < sizeof want - 24; i++)
    w += (size_t)(dims[i] ? snprintf(want + w, sizeof want - w, "%s%llu", i ? ", " : "", (unsigned long long)dims[i])
                          : snprintf(want + w, sizeof want - w, "%s*", i ? ", " : ""));
  for (uint32_t i = 0; i < a->ndim && g < sizeof got - 24; i++)
    g += (size_t)snprintf(got + g, sizeof got - g, "%s%llu", i ? ", " : "", (unsigned long long)a->shape[i]);
  want[w] = got[g] = 0;
  return kvp__err(KVP_EFORMAT, "%s: npy 'shape' is (%s), expected (%s)", name, got, want);
}

int kvp__npy_write_f64(const char *path, uint32_t ndim, const uint64_t *shape, const double *data) {
  char hdr[256], dims[200];
  size_t d = 0;
  uint64_t count = 1;
  dims[0] = 0;
  for (uint32_t i = 0; i < ndim && d < sizeof dims - 24; i++) {
    d += (size_t)snprintf(dims + d, sizeof dims - d, "%s%llu", i ? ", " : "", (unsigned long long)shape[i]);
    count *= shape[i];
  }
  /* Python's tuple syntax: (3,) for one dimension, (3, 4) for more */
  int n = snprintf(hdr, sizeof hdr, "{'descr': '<f8', 'fortran_order': False, 'shape': (%s%s), }", dims,
                   ndim == 1 ? "," : "");
  size_t total = 10 + (size_t)n + 1, pad = (64 - total % 64) % 64;
  FILE *f = fopen(path, "wb");
  if (!f) return kvp__err(KVP_EINVAL, "%s: cannot create: %s", path, strerror(errno));
  unsigned char pre[10];
  memcpy(pre, MAGIC, 6);
  pre[6] = 1, pre[7] = 0;
  size_t hl = (size_t)n + pad + 1;
  pre[8] = (unsigned char)(hl & 0xff), pre[9] = (unsigned char)(hl >> 8);
  bool ok = fwrite(pre, 1, 10, f) == 10 && fwrite(hdr, 1, (size_t)n, f) == (size_t)n;
  for (size_t i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
  ok = ok && fputc('\n', f) != EOF && fwrite(data, sizeof *data, count, f) == count;
  ok = (fclose(f) == 0) && ok;
  return ok ? KVP_OK : kvp__err(KVP_EINVAL, "%s: write failed", path);
}
