"""Plain-jnp router math: the reference backend (written for clarity) and the pieces it shares.

Everything here works on a flat `[T, E]` token-by-expert layout and in float32, whatever the input
dtype; `expertd.kernels.router` validates arguments and flattens leading dims before calling in.
The formulas are those of `reference/moe-semantics.md` sections 1 and 2 (TransformerEngine's fused
router), restated:

  score      softmax (pre: over all E; post: raw logits), sigmoid, or sqrt(softplus(x))
  selection  top-k of `score + expert_bias`, optionally limited to the best `group_topk` groups
             (group score = sum of the top `topk // group_topk` scores in the group, or of the top
             `group_score_topk` where given: Hugging Face's 2); ties go to the lowest expert index
             (`lax.top_k` semantics). Beyond TE, a bias may also steer softmax-pre selection
             (ERNIE 4.5: probs + bias); its weights stay the unbiased probabilities.
  weights    softmax post: softmax over the k selected logits; softmax pre: the selected
             probabilities as they are; sigmoid / sqrtsoftplus: the unbiased selected scores,
             divided by (their sum + 1e-20) when topk > 1
  probs      scaling_factor * weights at the selected experts, 0 elsewhere, in the logits dtype

`routing_weights` (weights given a fixed routing map) is differentiable and is what the backward of
every backend differentiates: the top-k selection itself has no gradient, and the gradient it gives
is exactly the hand-derived backward of moe-semantics.md section 1.6.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

# Added to the sum of sigmoid / sqrtsoftplus weights before normalising (as TransformerEngine).
NORMALISATION_EPS = 1e-20
# softplus(x) is taken as x above this threshold (as torch.nn.functional.softplus and TE).
SOFTPLUS_THRESHOLD = 20.0

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Validated, hashable router settings (static under jit). Grouping is off when group_topk == 0."""

    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int = 0
    group_topk: int = 0
    scaling_factor: float = 1.0
    has_bias: bool = False
    aux_scores: bool = False  # compute_aux_scores=True: dense normalised scores, plain top-k
    group_score_topk: int = 0  # scores summed per group; 0: topk // group_topk (TE's rule)

    @property
    def grouped(self) -> bool:
        return self.group_topk > 0 and not self.aux_scores

    @property
    def group_score_k(self) -> int:
        """How many of its best scores make a group's score."""
        return self.group_score_topk or self.topk // self.group_topk


@jax.custom_jvp
def sigmoid(x):
    """1 / (1 + exp(-x)) elementwise, fp32: the formula TE and the Pallas-Triton lowering use."""
    return 1.0 / (1.0 + jnp.exp(-x))


@sigmoid.defjvp
def _sigmoid_jvp(primals, tangents):
    # y (1 - y): finite where autodiff of the formula gives inf / inf (x -> -inf).
    (x,), (dx,) = primals, tangents
    y = sigmoid(x)
    return y, y * (1.0 - y) * dx


@jax.custom_jvp
def sqrtsoftplus(x):
    """sqrt(softplus(x)) elementwise, fp32; softplus(x) = x for x > 20, else log1p(exp(x))."""
    softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
    return jnp.sqrt(softplus)


@sqrtsoftplus.defjvp
def _sqrtsoftplus_jvp(primals, tangents):
    # d/dx sqrt(softplus(x)) = sigmoid(x) / (2 y); the eps keeps y == 0 (x -> -inf) finite, as TE.
    (x,), (dx,) = primals, tangents
    y = sqrtsoftplus(x)
    slope = jnp.where(x > SOFTPLUS_THRESHOLD, 1.0, sigmoid(x)) / (2.0 * y + NORMALISATION_EPS)
    return y, slope * dx


@jax.custom_jvp
def normalise(w):
    """w / (sum(w) + 1e-20) over the last axis (sigmoid / sqrtsoftplus weights)."""
    return w / (w.sum(axis=-1, keepdims=True) + NORMALISATION_EPS)


@normalise.defjvp
def _normalise_jvp(primals, tangents):
    # (dw - y sum(dw)) / (S + eps): the same derivative as autodiff's dw/S' - w sum(dw)/S'^2, but
    # without S'^2, which underflows to 0 (0/0 = NaN) when every weight is ~0 (very negative logits).
    (w,), (dw,) = primals, tangents
    denominator = w.sum(axis=-1, keepdims=True) + NORMALISATION_EPS
    y = w / denominator
    return y, (dw - y * dw.sum(axis=-1, keepdims=True)) / denominator


def activation(x, score_function: str):
    """The elementwise score of sigmoid / sqrtsoftplus routing on fp32 logits `[T, E]`."""
    if score_function == "sigmoid":
        return sigmoid(x)
    if score_function == "sqrtsoftplus":
        return sqrtsoftplus(x)
    raise ValueError(f"no elementwise activation for score_function={score_function!r}")


def selection_scores(logits, expert_bias, cfg: RouterConfig):
    """The fp32 `[T, E]` values top-k selects on (before group masking)."""
    x = logits.astype(jnp.float32)
    if cfg.aux_scores:
        return aux_scores_reference(logits, cfg.score_function)
    if cfg.score_function == "softmax":
        if not cfg.use_pre_softmax:
            return x
        s = jax.nn.softmax(x, axis=-1)
        return s if expert_bias is None else s + expert_bias.astype(jnp.float32)
    s = activation(x, cfg.score_function)
    if expert_bias is not None:
        s = s + expert_bias.astype(jnp.float32)
    return s


def group_mask(scores, cfg: RouterConfig):
    """Bool `[T, E]`: True for experts in each token's `group_topk` best groups."""
    t, e = scores.shape
    group_size = e // cfg.num_groups
    per_group = scores.reshape(t, cfg.num_groups, group_size)
    group_scores = lax.top_k(per_group, cfg.group_score_k)[0].sum(axis=-1)  # [T, G]
    _, kept = lax.top_k(group_scores, cfg.group_topk)  # [T, group_topk]
    kept_groups = jax.nn.one_hot(kept, cfg.num_groups, dtype=jnp.bool_).any(axis=-2)  # [T, G]
    return jnp.repeat(kept_groups, group_size, axis=-1)


def select_experts(scores, cfg: RouterConfig):
    """Bool routing map `[T, E]` with exactly topk True per row (lowest index wins ties)."""
    if cfg.grouped:
        scores = jnp.where(group_mask(scores, cfg), scores, -jnp.inf)
    _, chosen = lax.top_k(scores, cfg.topk)  # [T, k]
    return jax.nn.one_hot(chosen, scores.shape[-1], dtype=jnp.bool_).any(axis=-2)


def aux_scores_reference(logits, score_function: str):
    """Dense fp32 `[T, E]` scores for the aux loss: softmax, or activation / (sum + 1e-20)."""
    x = logits.astype(jnp.float32)
    if score_function == "softmax":
        return jax.nn.softmax(x, axis=-1)
    return normalise(activation(x, score_function))


def routing_weights(logits, expert_bias, routing_map, cfg: RouterConfig):
    """Probs `[T, E]` (logits dtype) for a given routing map; differentiable w.r.t. `logits`.

    With `cfg.aux_scores` it returns the dense fp32 aux scores instead (the map is not used).
    """
    if cfg.aux_scores:
        return aux_scores_reference(logits, cfg.score_function)
    x = logits.astype(jnp.float32)
    if cfg.score_function == "softmax":
        if cfg.use_pre_softmax:  # the unbiased probabilities, no renormalisation
            w = jnp.where(routing_map, jax.nn.softmax(x, axis=-1), 0.0)
        else:
            w = jax.nn.softmax(jnp.where(routing_map, x, -jnp.inf), axis=-1)
    else:
        s = activation(x, cfg.score_function)
        if expert_bias is not None:
            # The bias only steers selection; TE reverts it by fp32 subtraction, and so do we.
            b = lax.stop_gradient(expert_bias.astype(jnp.float32))
            s = (s + b) - b
        w = jnp.where(routing_map, s, 0.0)
        if cfg.topk > 1:
            w = normalise(w)
    if cfg.scaling_factor != 1.0:
        w = w * jnp.float32(cfg.scaling_factor)
    return w.astype(logits.dtype)


def router_reference(logits, expert_bias, cfg: RouterConfig):
    """Reference router on `[T, E]` logits -> (probs `[T, E]`, routing_map bool `[T, E]`).

    probs are in the logits dtype (fp32 aux scores with `cfg.aux_scores`); autodiff through this
    function is the reference backward.
    """
    scores = lax.stop_gradient(selection_scores(logits, expert_bias, cfg))
    routing_map = select_experts(scores, cfg)
    return routing_weights(logits, expert_bias, routing_map, cfg), routing_map
