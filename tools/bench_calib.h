/*
 * tools/bench_calib.h - kvpool-bench's kvquant calibration figures
 * (tools/bench_calib.c).
 */
#ifndef KVP_TOOLS_BENCH_CALIB_H
#define KVP_TOOLS_BENCH_CALIB_H

/* Print kvquant_calib_s and kvquant_calib_synthetic_s (a table line each
 * unless json_only, then a JSON line each); quick: 2 layers, not 32. */
void bench_kvquant_calib(int quick, int json_only);

#endif
