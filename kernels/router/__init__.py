"""Top-k MoE routing with TransformerEngine's semantics (see reference/moe-semantics.md, 1 and 2).

Public API (names and parameters follow TE's JAX router):

  fused_topk_with_score_function(logits [..., E], topk, ...) -> (probs [..., E], routing_map [..., E])
  fused_moe_aux_loss(probs [T, C], tokens_per_expert [C], topk, coeff) -> fp32 scalar
  topk_ids_and_weights(probs [..., E], routing_map [..., E], topk) -> (ids int32 [..., k], weights fp32 [..., k])

Backends (`backend=`): "reference" (plain jnp, the oracle), "xla" (plain jnp arranged for speed),
"pallas" (one fused Pallas kernel per token block; compiled on GPU, interpret mode on CPU) and
"auto" (the fastest measured backend for the platform, see `AUTO_BACKEND`). All backends give the
same routing maps (ties go to the lowest expert index) and the same backward: the gradient of
`routing_weights` for the chosen map, i.e. moe-semantics.md section 1.6, in fp32.

Config arguments are Python values (static under `jax.jit`); arrays may be token-sharded.

An op family in megablox's manner: this door exports the public names; beside it
  ops        the public ops: argument checks, backend choice, the shared custom VJP
  reference  the plain-jnp math (the "reference" backend, and the weights every backward
             differentiates: routing_weights); RouterConfig, SCORE_FUNCTIONS
  xla        the "xla" backend (router_xla)
  pallas     the "pallas" backend (router_pallas), imported only when it runs
Imports point inward: ops uses reference, xla and pallas; the backends use reference only.
"""
from expertd.kernels.router.ops import (
    AUTO_BACKEND,
    BACKENDS,
    LOGITS_DTYPES,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
    make_router_config,
    resolve_backend,
    topk_ids_and_weights,
)
from expertd.kernels.router.reference import SCORE_FUNCTIONS, RouterConfig, router_reference, routing_weights

__all__ = [
    "AUTO_BACKEND", "BACKENDS", "LOGITS_DTYPES", "SCORE_FUNCTIONS", "RouterConfig", "fused_moe_aux_loss",
    "fused_topk_with_score_function", "make_router_config", "resolve_backend", "router_reference", "routing_weights",
    "topk_ids_and_weights",
]
