/*
 * codecs/npy.h - a strict reader of NumPy .npy files, for calibration
 * inputs (attention-mass summaries, K/V samples, Fisher weights).
 *
 * Accepted: format versions 1.0, 2.0 and 3.0; little-endian float32
 * ('<f4'), float64 ('<f8') and float16 ('<f2'); C order
 * (fortran_order False); 1 to 8 dimensions. The file is mapped read-only,
 * so a sample file of many GiB costs address space, not memory; elements
 * are read through kvp__npy_at / kvp__npy_f32, converted on the fly.
 *
 * Every failure is KVP_EFORMAT (or KVP_ENOENT when the file cannot be
 * opened) with a message naming the file and what is wrong: the magic, the
 * version, the header field (descr, fortran_order, shape), or the size
 * (a truncated file says how many bytes the shape needs and how many the
 * file has).
 */
#ifndef KVP_NPY_H
#define KVP_NPY_H

#include "../util/util.h"

#define KVP__NPY_MAX_DIMS 8

typedef enum { KVP__NPY_F16 = 2, KVP__NPY_F32 = 4, KVP__NPY_F64 = 8 } kvp__npy_dtype;

typedef struct kvp__npy {
  uint32_t ndim;                        /* dimensions, 1..KVP__NPY_MAX_DIMS */
  uint64_t shape[KVP__NPY_MAX_DIMS];    /* extent of each, C order */
  uint64_t count;                       /* elements: product of shape */
  kvp__npy_dtype dtype;                 /* element type; its value is the item size */
  const unsigned char *data;            /* first element (inside the mapping) */
  void *map;                            /* the mapping, for the unmap */
  size_t map_bytes;                     /* its length */
} kvp__npy;

/* Open and validate path. On error *a is zeroed and nothing is held. */
int kvp__npy_open(kvp__npy *a, const char *path);
/* The same over a buffer the caller keeps alive (tests, embedded samples);
 * name stands for the file in messages. */
int kvp__npy_parse(kvp__npy *a, const void *buf, size_t len, const char *name);
void kvp__npy_close(kvp__npy *a); /* zeroes *a; zeroed is fine */

/* Element i (flat, C order) as double / float. i < count. */
double kvp__npy_at(const kvp__npy *a, uint64_t i);
/* Elements [i0, i0 + n) as float into out. */
void kvp__npy_f32(const kvp__npy *a, uint64_t i0, uint64_t n, float *out);

/* KVP_EFORMAT naming name and the expected shape unless a has exactly
 * ndim dimensions equal to dims (an entry of 0 accepts any extent). */
int kvp__npy_expect(const kvp__npy *a, const char *name, uint32_t ndim, const uint64_t *dims);

/* Write a float64 array (tests and tools). KVP_EINVAL naming path on I/O
 * failure. */
int kvp__npy_write_f64(const char *path, uint32_t ndim, const uint64_t *shape, const double *data);

#endif /* KVP_NPY_H */
