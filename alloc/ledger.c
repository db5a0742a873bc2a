/*
 * alloc/ledger.c - the ledger: the pool's byte truth, and its strict budget.
 *
 * Invariants, at every instant outside a writer section:
 *   requested <= allocated <= committed <= reserved
 *   allocated <= budget   (checked before every allocation: kvp__ledger_fits)
 *   peak(allocated) <= budget
 * The writer updates the figures between kvp__ledger_begin/end, a sequence
 * lock: readers copy the struct and retry while the count is odd or moved,
 * so a snapshot never mixes two states (e.g. allocated from before a free
 * and committed from after it).
 */
#include "alloc.h"

#include <string.h>

void kvp__ledger_init(kvp__ledger *l, uint64_t reserved_bytes, uint64_t budget_bytes) {
  memset(l, 0, sizeof *l);
  l->reserved_bytes = reserved_bytes;
  l->budget_bytes = budget_bytes;
}

/* kvp__gauge_add/sub, kvp__count_add and kvp__ledger_begin/end are inline in alloc.h. */

/* Copy the figures word by word with relaxed atomic loads, so the copy
 * itself is not a data race under the C11 model (and TSan agrees). */
static void copy_words(uint64_t *dst, const uint64_t *src, size_t nwords) {
  for (size_t i = 0; i < nwords; i++) dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

void kvp__ledger_snapshot(const kvp__ledger *l, kvp__ledger *out) {
  const size_t off = offsetof(kvp__ledger, requested);
  const size_t nwords = (sizeof *l - off) / sizeof(uint64_t);
  _Static_assert((sizeof(kvp__ledger) - offsetof(kvp__ledger, requested)) % sizeof(uint64_t) == 0,
                 "ledger figures are whole 64-bit words");
  for (;;) {
    uint64_t s0 = atomic_load_explicit(&l->seq, memory_order_acquire);
    if (s0 & 1) continue;
    copy_words((uint64_t *)((char *)out + off), (const uint64_t *)((const char *)l + off), nwords);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&l->seq, memory_order_relaxed) == s0) {
      atomic_store_explicit(&out->seq, s0, memory_order_relaxed);
      return;
    }
  }
}
