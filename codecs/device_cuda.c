/*
 * codecs/device_cuda.c - the built-in codecs' device ops, host side: the
 * launch of their kernels (kernels/codec.cu) with a message on failure,
 * the kernels' parameters of a binding for the paged gather, and the
 * device-side static data of the bindings that have some (kvquant's tables).
 * Built only with CUDA (files ending in _cuda.c are left out otherwise).
 */
#include "builtin.h"
#include "codecs.h"
#include "kvquant.h"

int kvp__dev_encode(const char *codec, const kvp__kparams *k, const kvp_codec_dev_job *jobs,
                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint64_t *status, void *stream) {
  int e = kvp__kern_encode(k, jobs, jobs_dev, njobs, status, stream);
  return e ? kvp__err(KVP_EDEVICE, "%s device encode of %u blocks: %s", codec, njobs, kvp__kern_errstr(e)) : KVP_OK;
}

int kvp__dev_decode(const char *codec, const kvp__kparams *k, const kvp_codec_dev_job *jobs,
                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, kvp_dtype out, void *stream) {
  int e = kvp__kern_decode(k, jobs, jobs_dev, njobs, (uint32_t)out, stream);
  return e ? kvp__err(KVP_EDEVICE, "%s device decode of %u blocks: %s", codec, njobs, kvp__kern_errstr(e)) : KVP_OK;
}

int kvp__codec_dev_prepare(const kvp_codec_vtable *vt, const void *inst) {
  if (kvp__codec_is_qvg(vt)) {
    kvp__qvg_kparams k;
    kvp__qvg_kparams_of(inst, &k);
    if (k.head_dim > KVP__QVG_DEV_MAX_DIM)
      return kvp__err(KVP_ENOTSUP, "%s: head_dim %u on the device: its k-means kernels keep a row in registers, at "
                      "most %u channels (a host region takes any head_dim)", kvp__qvg_name(inst), k.head_dim,
                      KVP__QVG_DEV_MAX_DIM);
    return KVP_OK;
  }
  return vt == &kvp__codec_kvquant ? kvp__kvq_dev_prepare(inst) : KVP_OK;
}

uint64_t kvp__codec_dev_static_bytes(const kvp_codec_vtable *vt, const void *inst) {
  return vt == &kvp__codec_kvquant ? kvp__kvq_dev_bytes(inst) : 0;
}

int kvp__codec_kparams(const kvp_codec_vtable *vt, const void *inst, kvp__kparams *out) {
  static const struct {
    const kvp_codec_vtable *vt;
    void (*fill)(const void *, kvp__kparams *);
  } twins[] = {{&kvp__codec_raw, kvp__raw_kparams},   {&kvp__codec_fp8, kvp__fp8_kparams},
               {&kvp__codec_int8, kvp__int8_kparams}, {&kvp__codec_kivi, kvp__kivi_kparams},
               {&kvp__codec_nvfp4, kvp__nvfp4_kparams}};
  for (size_t i = 0; i < sizeof twins / sizeof twins[0]; i++)
    if (twins[i].vt == vt) {
      twins[i].fill(inst, out);
      return KVP_OK;
    }
  return KVP_ENOTSUP;
}
