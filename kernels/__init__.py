"""expertd.kernels: the MoE math as a library (JAX), with typed params and handles.

Public modules:
  moe       the whole layer: MoEConfig, MoEParams, init_params, prepare_params (once after
            loading, for the fastest layout), moe_layer, route, check_token_ids, compiler_options
            (the families' semantics: MoEConfig's docstring and docs/semantics.md)
  routing   a layer's routing in Hugging Face semantics (router_logits, route, route_from_logits,
            hash routing and check_token_ids)
  router    top-k routing with TransformerEngine's semantics (fused_topk_with_score_function,
            fused_moe_aux_loss): an op family, its door beside router/{ops, reference, xla, pallas}
  dispatch  permute / unpermute tokens into expert-major rows (Permutation)
  experts   the grouped expert FFN by backend (grouped_ffn, choose_backend, compiler_options): an
            op family, its door beside experts/{ops, xla, pallas}
  ep        the expert-parallel layer over a mesh axis (shard_params, ep_moe_layer)
  cpu       the native CPU backend behind one door (build options, custom calls, weight layout,
            CPU backend policy); its tests' and benchmarks' look inside in cpu.diagnostics
  names     the expert backends and the native CPU ISA levels, JAX-free (what a server's config
            checks its flags against; experts.BACKENDS and cpu.ISA_LEVELS are these)
  moe_reference  the float64 whole-layer reference, numpy only (moe_oracle, family_config,
            tolerance): what the backends, the expert-parallel layer and GPU runs are checked against
Supporting modules: config (MoEConfig), params (MoEParams, RouterParams), ffn (the grouped-FFN
contract and reference), ragged (the ragged exchange), ep_rank (one rank's step of the
expert-parallel layer), eplb (expert-parallel load balancing: where the experts' slots live).

No gRPC, no metrics, no config files and no reads of the process's env variables live here: every
setting is an argument (the native CPU build's through `cpu.configure`).
"""
