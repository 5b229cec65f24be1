"""`HFConfig`: a Hugging Face config.json read the way every family module needs it.

- Nested configs: multimodal and wrapper models (Qwen3.5, Kimi-K2.5, Llama 4, Gemma 4, Mistral
  Large 3 / 4, Step-3.7, GLM-5-Next) keep the decoder's keys under `text_config`; a key is looked
  up there first, then at the top level.
- transformers 4.x and 5.x spellings: a lookup names every accepted spelling of a key
  (`num_experts` / `num_local_experts`, `torch_dtype` / `dtype`, ...); two spellings with different
  values are refused, naming both.
- Errors are `ConfigError` (a ValueError) that name the key as it sits in config.json
  (`config['text_config']['num_experts']`), what was expected and what came.

Layer rules shared by several families are here too (`sparse_by_types`, `sparse_from`,
`sparse_by_step`): which decoder layers hold an MoE block.
"""
from __future__ import annotations

from collections.abc import Mapping

# config.json activation names -> expertd's (expertd.kernels.config.ACTIVATIONS)
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# mlp_layer_types values: MoE blocks and dense MLPs
SPARSE_TYPES = ("sparse", "moe")
DENSE_TYPES = ("dense", "mlp")
_MISSING = object()


class ConfigError(ValueError):
    """config.json cannot be served as it stands; the message names the key."""


class HFConfig:
    """Read-only view of a config.json dict (see the module docstring).

    Attributes:
      raw: the whole config.json dict.
      text: its `text_config` dict, or None.
    """

    def __init__(self, config: Mapping):
        if not isinstance(config, Mapping):
            raise ConfigError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
        self.raw = dict(config)
        text = self.raw.get("text_config")
        if text is not None and not isinstance(text, Mapping):
            raise ConfigError(f"config['text_config'] must be an object, got {type(text).__name__}")
        self.text = dict(text) if text is not None else None

    # ------------------------------------------------------------------ identity

    @property
    def model_type(self) -> str | None:
        """The top-level model_type."""
        return self.raw.get("model_type")

    @property
    def text_model_type(self) -> str | None:
        """text_config's model_type (None without a text_config)."""
        return self.text.get("model_type") if self.text else None

    @property
    def architectures(self) -> list[str]:
        found = self.raw.get("architectures") or []
        return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []

    # ------------------------------------------------------------------ lookups

    def where(self, key: str) -> str:
        """How `key` is written in messages: where it is found, else where it would be read."""
        if self.text is not None and (key in self.text or key not in self.raw):
            return f"config['text_config'][{key!r}]"
        return f"config[{key!r}]"

    def find(self, *keys: str) -> tuple[str, object] | None:
        """(spelling, value) of the first of `keys` set (not null), text_config first; None if none is.

        Two spellings set to different values raise ConfigError naming both."""
        found = []
        for holder in (self.text, self.raw):
            if holder is None:
                continue
            for key in keys:
                if holder.get(key) is not None:
                    found.append((key, holder[key]))
            if found:
                break
        for key, value in found[1:]:
            if value != found[0][1]:
                raise ConfigError(f"{self.where(found[0][0])} = {found[0][1]!r} and {self.where(key)} = {value!r} "
                                  "are two spellings of one setting with different values")
        return found[0] if found else None

    def get(self, *keys: str, default=None):
        """The value of the first of `keys` that is set, else `default` (see `find`)."""
        found = self.find(*keys)
        return default if found is None else found[1]

    def require(self, *keys: str, default=_MISSING):
        """As `get`, but a missing key without a default raises ConfigError naming it."""
        found = self.find(*keys)
        if found is not None:
            return found[1]
        if default is not _MISSING:
            return default
        spellings = " or ".join(repr(k) for k in keys)
        raise ConfigError(f"{self.where(keys[0])} ({spellings}) is required for {self.describe()}")

    def integer(self, *keys: str, default=_MISSING, minimum: int = 1) -> int:
        """An int setting (bools refused), at least `minimum`."""
        value = self.require(*keys, default=default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{self.where(keys[0])} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, *keys: str, default=_MISSING) -> float:
        value = self.require(*keys, default=default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{self.where(keys[0])} must be a number, got {value!r}")
        return float(value)

    def flag(self, *keys: str, default=_MISSING) -> bool:
        value = self.require(*keys, default=default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where(keys[0])} must be true or false, got {value!r}")
        return value

    def activation(self, *keys: str, default: str = "silu") -> str:
        """expertd's activation for `hidden_act` (or the keys given), e.g. "gelu_pytorch_tanh" -> "gelu_tanh"."""
        keys = keys or ("hidden_act",)
        name = self.require(*keys, default=default)
        if name not in HF_ACTIVATIONS:
            raise ConfigError(f"{self.where(keys[0])} must be one of {sorted(HF_ACTIVATIONS)}, got {name!r}")
        return HF_ACTIVATIONS[name]

    def num_layers(self, *keys: str) -> int:
        """Decoder layers (`num_hidden_layers`, or the family's spelling)."""
        return self.integer(*(keys or ("num_hidden_layers",)))

    def dtype(self) -> str | None:
        """The checkpoint's dtype as config.json states it (`dtype` in transformers 5, `torch_dtype`
        in 4.x), e.g. "bfloat16"; None when absent."""
        value = self.get("dtype", "torch_dtype")
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{self.where('dtype')} must be a dtype name such as 'bfloat16', got {value!r}")
        return value.removeprefix("torch.") if value else None

    def describe(self) -> str:
        text = f", text_config model_type {self.text_model_type!r}" if self.text else ""
        return f"model_type {self.model_type!r}{text}"


# ---------------------------------------------------------------------- layer rules


def layer_types(c: HFConfig, key: str = "mlp_layer_types") -> list[str] | None:
    """`mlp_layer_types` (one entry per decoder layer) or None when config.json has none."""
    types = c.get(key)
    if types is None:
        return None
    n = c.num_layers()
    if not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{c.where(key)} must list one string per decoder layer ({n}), got {types!r}")
    return types


def sparse_by_types(c: HFConfig, types: list[str], sparse=SPARSE_TYPES, dense=DENSE_TYPES) -> list[int]:
    """Layers whose `mlp_layer_types` entry names an MoE block; an unknown entry raises ConfigError."""
    out = []
    for i, kind in enumerate(types):
        if kind in sparse:
            out.append(i)
        elif kind not in dense:
            raise ConfigError(f"{c.where('mlp_layer_types')}[{i}] is {kind!r}; expected one of "
                              f"{sorted(sparse + dense)}")
    return out


def sparse_from(c: HFConfig, *, first_dense_default: int = 0, freq_key: str | None = "moe_layer_freq") -> list[int]:
    """DeepSeek style: `mlp_layer_types` where given; else layers i >= first_k_dense_replace (and
    i % moe_layer_freq == 0 where the family reads it)."""
    types = layer_types(c)
    if types is not None:
        return sparse_by_types(c, types)
    first = c.integer("first_k_dense_replace", default=first_dense_default, minimum=0)
    freq = c.integer(freq_key, default=1) if freq_key else 1
    return [i for i in range(c.num_layers()) if i >= first and i % freq == 0]


def sparse_by_step(c: HFConfig) -> list[int]:
    """Qwen style: layer i unless i is in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0."""
    step = c.integer("decoder_sparse_step", default=1)
    dense = c.get("mlp_only_layers", default=[])
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"{c.where('mlp_only_layers')} must be a list of layer indices, got {dense!r}")
    return [i for i in range(c.num_layers()) if i not in set(dense) and (i + 1) % step == 0]


def effective_groups(c: HFConfig, family: str, num_experts: int, topk: int, *, n_group_default: int,
                     topk_group_default: int) -> dict:
    """MoEConfig's num_groups / group_topk / group_score_topk for a grouped router (DeepSeek-V3's and
    Mistral's): transformers scores a group by the sum of its top 2 selection scores, so
    group_score_topk = 2. Grouping that keeps every group (n_group <= 1 or topk_group >= n_group)
    changes nothing and is dropped. A grouping the kept groups cannot fill (topk above topk_group x
    the group size) raises ConfigError naming the keys."""
    n_group = c.integer("n_group", default=n_group_default)
    topk_group = c.integer("topk_group", default=topk_group_default)
    if n_group <= 1 or topk_group >= n_group:
        return {}
    size = num_experts // n_group
    if num_experts % n_group or size < 2 or topk > topk_group * size:
        raise ConfigError(
            f"{family}: group-limited routing with n_group={n_group}, topk_group={topk_group}, {num_experts} experts "
            f"and num_experts_per_tok={topk} is not servable: the experts must split into n_group equal groups of "
            f"at least 2 (a group scores by its top 2) and the topk_group kept groups must hold num_experts_per_tok "
            f"experts")
    return {"num_groups": n_group, "group_topk": topk_group, "group_score_topk": 2}
