/*
 * python/bench/kvpool-pyabi.c - the layout of the public structs as the C
 * compiler sees them, one JSON object: {"struct": {"size": n, "fields":
 * {"name": offset, ...}}, ...}. python/tests/test_abi.py compares it with
 * the ctypes mirrors in python/kvpool/_lib.py, so the two cannot drift.
 */
#include <stddef.h>
#include <stdio.h>

#include "kvpool.h"

static int first;

static void begin(const char *name, size_t size) {
  printf("%s\"%s\": {\"size\": %zu, \"fields\": {", first ? "" : ", ", name, size);
  first = 0;
}
static int nf;
#define F(type, field) printf("%s\"%s\": %zu", nf++ ? ", " : "", #field, offsetof(type, field))
#define END() (printf("}}"), nf = 0)

int main(void) {
  first = 1;
  printf("{");
  begin("kvp_config", sizeof(kvp_config));
  F(kvp_config, struct_size); F(kvp_config, n_layers); F(kvp_config, n_kv_heads); F(kvp_config, head_dim);
  F(kvp_config, k_dtype); F(kvp_config, v_dtype); F(kvp_config, memory); F(kvp_config, device);
  F(kvp_config, region_bytes); F(kvp_config, budget_bytes); F(kvp_config, block_tokens); F(kvp_config, codecs);
  F(kvp_config, policy); F(kvp_config, flags);
  END();
  begin("kvp_seq_config", sizeof(kvp_seq_config));
  F(kvp_seq_config, struct_size); F(kvp_seq_config, mode); F(kvp_seq_config, step_tokens);
  F(kvp_seq_config, n_steps); F(kvp_seq_config, budget_fraction); F(kvp_seq_config, policy);
  F(kvp_seq_config, tokens); F(kvp_seq_config, n_tokens);
  END();
  begin("kvp_kv", sizeof(kvp_kv));
  F(kvp_kv, k); F(kvp_kv, v); F(kvp_kv, stream);
  END();
  begin("kvp_read_req", sizeof(kvp_read_req));
  F(kvp_read_req, struct_size); F(kvp_read_req, head); F(kvp_read_req, out_dtype); F(kvp_read_req, k_out);
  F(kvp_read_req, v_out); F(kvp_read_req, positions_out); F(kvp_read_req, capacity_tokens);
  F(kvp_read_req, n_tokens); F(kvp_read_req, stream);
  END();
  begin("kvp_view_block", sizeof(kvp_view_block));
  F(kvp_view_block, head); F(kvp_view_block, block_pos0); F(kvp_view_block, first); F(kvp_view_block, n_tokens);
  F(kvp_view_block, cap_tokens); F(kvp_view_block, codec); F(kvp_view_block, page); F(kvp_view_block, page_bytes);
  END();
  begin("kvp_view", sizeof(kvp_view));
  F(kvp_view, seq); F(kvp_view, layer); F(kvp_view, n_blocks); F(kvp_view, blocks);
  END();
  begin("kvp_gather_item", sizeof(kvp_gather_item));
  F(kvp_gather_item, seq); F(kvp_gather_item, layer); F(kvp_gather_item, row0); F(kvp_gather_item, n_rows);
  END();
  begin("kvp_gather_req", sizeof(kvp_gather_req));
  F(kvp_gather_req, struct_size); F(kvp_gather_req, items); F(kvp_gather_req, n_items); F(kvp_gather_req, k_out);
  F(kvp_gather_req, v_out); F(kvp_gather_req, positions_out); F(kvp_gather_req, capacity_rows);
  F(kvp_gather_req, workspace); F(kvp_gather_req, workspace_bytes); F(kvp_gather_req, n_rows);
  F(kvp_gather_req, n_launches); F(kvp_gather_req, workspace_needed); F(kvp_gather_req, stream);
  END();
  begin("kvp_attend_req", sizeof(kvp_attend_req));
  F(kvp_attend_req, struct_size); F(kvp_attend_req, layer); F(kvp_attend_req, seqs); F(kvp_attend_req, batch);
  F(kvp_attend_req, n_q_heads); F(kvp_attend_req, q); F(kvp_attend_req, scale); F(kvp_attend_req, out);
  F(kvp_attend_req, out_dtype); F(kvp_attend_req, workspace); F(kvp_attend_req, workspace_bytes);
  F(kvp_attend_req, split_tokens); F(kvp_attend_req, workspace_needed); F(kvp_attend_req, n_splits);
  F(kvp_attend_req, token_heads); F(kvp_attend_req, bytes_read); F(kvp_attend_req, stream);
  END();
  begin("kvp_layer_info", sizeof(kvp_layer_info));
  F(kvp_layer_info, struct_size); F(kvp_layer_info, codec); F(kvp_layer_info, group_tokens);
  F(kvp_layer_info, block_tokens); F(kvp_layer_info, step_block_tokens); F(kvp_layer_info, bytes_per_token);
  F(kvp_layer_info, source_bytes_per_token);
  END();
  begin("kvp_gauge", sizeof(kvp_gauge));
  F(kvp_gauge, current); F(kvp_gauge, peak); F(kvp_gauge, total);
  END();
  begin("kvp_usage", sizeof(kvp_usage));
  F(kvp_usage, requested_bytes); F(kvp_usage, allocated_bytes); F(kvp_usage, npages);
  END();
  begin("kvp_stats", sizeof(kvp_stats));
  F(kvp_stats, struct_size); F(kvp_stats, version);
#define SF(kind, f, key, help) F(kvp_stats, f);
  KVP_STATS_LIST(SF)
#undef SF
  F(kvp_stats, page_types); F(kvp_stats, kv);
  END();
  begin("kvp_seq_usage", sizeof(kvp_seq_usage));
  F(kvp_seq_usage, seq); F(kvp_seq_usage, usage);
  END();
  begin("kvp_seq_desc", sizeof(kvp_seq_desc));
  F(kvp_seq_desc, struct_size); F(kvp_seq_desc, mode); F(kvp_seq_desc, n_steps); F(kvp_seq_desc, n_positions);
  F(kvp_seq_desc, in_step); F(kvp_seq_desc, tokens_retained); F(kvp_seq_desc, tokens_evicted);
  F(kvp_seq_desc, retained_tokens); F(kvp_seq_desc, evicted_tokens); F(kvp_seq_desc, page_types);
  END();
  printf(", \"stats_keys\": [");
  int k = 0;
#define SK(kind, f, key, help) printf("%s[\"%s\", \"%s\", \"%s\"]", k++ ? ", " : "", #kind, #f, key);
  KVP_STATS_LIST(SK)
#undef SK
  printf("], \"page_types\": [");
  k = 0;
#define PT(name, key) printf("%s\"%s\"", k++ ? ", " : "", key);
  KVP_PAGE_TYPE_LIST(PT)
#undef PT
  printf("], \"status\": [");
  k = 0;
#define ST(name, value, desc) printf("%s[\"%s\", %d]", k++ ? ", " : "", #name, value);
  KVP_STATUS_LIST(ST)
#undef ST
  printf("]}\n");
  return 0;
}
