"""The ``[model]`` section: what is served (preset or checkpoint, layers, dtype, backend, devices, EPLB)."""
from __future__ import annotations

import dataclasses
import importlib.util

from expertd.kernels.names import EXPERT_BACKENDS, EXPERT_WEIGHTS
from expertd.server.config.fields import (
    DTYPES,
    option,
    optional_str,
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str | None = option(None, "model preset with seeded random weights: tiny (default when no "
                                "--checkpoint), mixtral-8x7b, qwen3-30b-a3b, deepseek-v3", parse=optional_str)
    checkpoint: str | None = option(None, "Hugging Face checkpoint directory (config.json + *.safetensors) of an "
                                    "MoE model (docs/models.md lists the families; `expertd inspect DIR` tells "
                                    "what serve would do)", parse=optional_str, metavar="DIR")
    layers: str | None = option(None, "MoE layer indices to serve, e.g. '1,3-5' (default: all MoE layers, or "
                                "--num-layers)", parse=optional_str, metavar="LIST")
    num_layers: int | None = option(None, "serve the first N MoE layers (default: all; tiny has 2)", parse=int,
                                    metavar="N")
    dtype: str = option("auto", "weight and compute dtype: float32 or bfloat16; auto: a checkpoint's own (float32 "
                        "-> float32, bfloat16 / float16 / FP8 / FP4 / INT4 -> bfloat16), bfloat16 for presets")
    seed: int = option(0, "seed of the preset weights (a pure function of seed, layer and tensor name)", parse=int)
    num_devices: int | None = option(None, "devices of the expert-parallel mesh (default: all visible devices)",
                                     parse=int, metavar="N")
    backend: str = option("auto", f"expert kernel backend: auto or one of {', '.join(EXPERT_BACKENDS)}")
    huge_pages: bool = option(True, "on CPU, move the weights onto transparent huge pages at load (BENCHMARKS.md)")
    panel_weights: bool = option(True, "on CPU with the native kernel, relay the expert weights out panel-major at "
                                       "load (same results, read faster; BENCHMARKS.md)")
    expert_weights: str = option("dtype", "routed expert weights as served: dtype (in --dtype) or int8 (on CPU with "
                                 "the native kernel: quantised at load to int8 with a scale per output channel, "
                                 "widened in registers, activations in --dtype; half bf16's bytes per decode step, "
                                 "a layer output's max relative error 1-2 percent of bf16's: docs/kernels.md)",
                                 metavar="dtype|int8")
    num_redundant_experts: int = option(0, "EPLB: extra expert slots per MoE layer on an expert-parallel mesh, "
                                        "holding replicas of the hottest experts (E + N must be divisible by the "
                                        "device count; 0: one slot per expert)", parse=int, metavar="N")
    eplb_interval_s: float = option(0.0, "EPLB: every S seconds, re-plan each layer's expert placement from the "
                                    "load of the last --expert-load-window-s and swap it in between steps (0: the "
                                    "placement made at start-up stays)", parse=float, metavar="SECONDS")

    def __post_init__(self):
        if self.preset is not None and self.checkpoint is not None:
            raise ValueError("give either --preset or --checkpoint, not both")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.backend != "auto" and self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"--backend must be 'auto' or one of {EXPERT_BACKENDS}, got {self.backend!r}")
        if self.backend == "tokamax" and importlib.util.find_spec("tokamax") is None:
            raise ValueError("--backend tokamax needs the tokamax package, which is not installed: "
                             "pip install 'expertd[tokamax]' (tokamax==0.0.12)")
        if self.expert_weights not in EXPERT_WEIGHTS:
            raise ValueError(f"--expert-weights must be one of {EXPERT_WEIGHTS}, got {self.expert_weights!r}")
        if self.expert_weights == "int8" and not self.panel_weights:
            raise ValueError("--expert-weights int8 is held in the native kernel's panels: drop --no-panel-weights")
        if self.layers is not None and self.num_layers is not None:
            raise ValueError("give either --layers or --num-layers, not both")
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"--num-devices must be >= 1, got {self.num_devices}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {self.num_layers}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"--num-redundant-experts must be >= 0, got {self.num_redundant_experts}")
        if not self.eplb_interval_s >= 0:
            raise ValueError(f"--eplb-interval-s must be >= 0, got {self.eplb_interval_s}")

    @property
    def name(self) -> str:
        """What GetModelInfo reports: the checkpoint directory or the preset name."""
        return self.checkpoint or self.preset or "tiny"
