"""Tables and JSON documents of the ``expertd`` client commands (info, route, forward, load).

Shapes: T tokens, H hidden, E experts, k top-k.
"""
from __future__ import annotations

import numpy as np

from expertd.client.codec import dtype_name
from expertd.client.messages import ExpertLoad
from expertd.client.pb.v1 import expert_pb2


def _table(header: list[str], rows: list[list[str]], *, bar_last: bool = False) -> str:
    """Right-aligned columns; with ``bar_last`` the last column (a bar) is left-aligned and unpadded."""
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = []
    for line in [header, *rows]:
        cells = [cell.rjust(width) for cell, width in zip(line, widths)]
        if bar_last:
            cells[-1] = line[-1]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def info_dict(info: expert_pb2.GetModelInfoResponse) -> dict:
    """GetModelInfo as plain JSON types (ints stay ints, dtypes are names)."""
    return {
        "model": info.model,
        "server_version": info.server_version,
        "dtype": dtype_name(info.dtype),
        "input_dtypes": [dtype_name(d) for d in info.input_dtypes],
        "buckets": list(info.buckets),
        "max_batch_tokens": info.max_batch_tokens,
        "max_request_tokens": info.max_request_tokens,
        "mesh": {
            "axis_names": list(info.mesh.axis_names),
            "axis_sizes": list(info.mesh.axis_sizes),
            "platform": info.mesh.platform,
            "num_devices": info.mesh.num_devices,
        },
        "layers": [
            {
                "index": layer.index,
                "kserve_model": f"moe-layer-{layer.index}",
                "hidden_size": layer.hidden_size,
                "intermediate_size": layer.intermediate_size,
                "num_experts": layer.num_experts,
                "topk": layer.topk,
                "router": {
                    "score_function": layer.router.score_function,
                    "use_pre_softmax": layer.router.use_pre_softmax,
                    "num_groups": layer.router.num_groups,
                    "group_topk": layer.router.group_topk,
                    "scaling_factor": layer.router.scaling_factor,
                    "has_expert_bias": layer.router.has_expert_bias,
                },
                "num_shared_experts": layer.num_shared_experts,
                "shared_intermediate_size": layer.shared_intermediate_size,
                "shared_expert_gate": layer.shared_expert_gate,
                "activation": layer.activation,
            }
            for layer in info.layers
        ],
    }


def info_table(info: expert_pb2.GetModelInfoResponse) -> str:
    mesh = ", ".join(f"{name}={size}" for name, size in zip(info.mesh.axis_names, info.mesh.axis_sizes)) or "-"
    lines = [
        f"model {info.model}   server {info.server_version}   dtype {dtype_name(info.dtype)}   "
        f"inputs {'/'.join(dtype_name(d) for d in info.input_dtypes)}",
        f"mesh {mesh} ({info.mesh.num_devices} {info.mesh.platform} devices)   "
        f"buckets {' '.join(map(str, info.buckets))}   "
        f"max batch tokens {info.max_batch_tokens}   max request tokens {info.max_request_tokens}",
        "",
    ]
    header = ["layer", "H", "I", "E", "k", "score", "pre-softmax", "groups", "scale", "bias", "shared", "activation",
              "kserve model"]
    rows = []
    for layer in info.layers:
        router = layer.router
        groups = f"{router.group_topk}/{router.num_groups}" if router.num_groups else "-"
        shared = f"{layer.num_shared_experts}x{layer.shared_intermediate_size}" if layer.num_shared_experts else "-"
        rows.append([
            str(layer.index), str(layer.hidden_size), str(layer.intermediate_size), str(layer.num_experts),
            str(layer.topk),
            router.score_function, "yes" if router.use_pre_softmax else "no", groups, f"{router.scaling_factor:g}",
            "yes" if router.has_expert_bias else "no", shared, layer.activation, f"moe-layer-{layer.index}",
        ])
    return "\n".join(lines) + _table(header, rows)


def _bar(value: float, top: float, width: int = 30) -> str:
    return "#" * (int(round(width * value / top)) if top > 0 else 0)


def routing_table(layer: int, topk_ids: np.ndarray, topk_weights: np.ndarray, tokens_per_expert: np.ndarray, *,
                  show: int = 4) -> str:
    """Tokens per expert (with a bar) and the top-k of the first ``show`` tokens.

    topk_ids / topk_weights: [T, k]; tokens_per_expert: [E].
    """
    total = int(tokens_per_expert.sum())
    top = float(tokens_per_expert.max()) if tokens_per_expert.size else 0.0
    rows = [[str(e), str(int(n)), f"{100.0 * n / total:.1f}%" if total else "-", _bar(n, top)] for e,
            n in enumerate(tokens_per_expert)]
    lines = [f"layer {layer}: {topk_ids.shape[0]} tokens, top-{topk_ids.shape[1]} of {tokens_per_expert.size} experts",
             _table(["expert", "tokens", "share", ""], rows, bar_last=True)]
    for t in range(min(show, topk_ids.shape[0])):
        picks = ", ".join(f"{int(i)}:{w:.3f}" for i, w in zip(topk_ids[t], topk_weights[t]))
        lines.append(f"token {t}: {picks}")
    return "\n".join(lines)


def array_summary(array: np.ndarray) -> dict:
    """Shape, dtype and float32 statistics of an array (NaN-safe: ``finite`` says if all are finite)."""
    values = np.asarray(array, dtype=np.float32)
    finite = bool(np.isfinite(values).all())
    stats = values if values.size else np.zeros(1, np.float32)
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "mean": float(np.nanmean(stats)),
        "std": float(np.nanstd(stats)),
        "min": float(np.nanmin(stats)),
        "max": float(np.nanmax(stats)),
        "finite": finite,
    }


def _imbalance(tokens: np.ndarray) -> float | None:
    """max/mean tokens per expert (1.0 is perfectly balanced); None before any token."""
    mean = float(tokens.mean()) if tokens.size else 0.0
    return float(tokens.max()) / mean if mean > 0 else None


def load_dict(loads: dict[int, ExpertLoad]) -> dict:
    return {
        "layers": [
            {
                "layer": layer,
                "window_seconds": load.window_seconds,
                "tokens_total": load.tokens_total.tolist(),
                "tokens_recent": load.tokens_recent.tolist(),
                "imbalance_total": _imbalance(load.tokens_total),
                "imbalance_recent": _imbalance(load.tokens_recent),
            }
            for layer, load in sorted(loads.items())
        ]
    }


def expert_load_table(loads: dict[int, ExpertLoad]) -> str:
    """One table per layer: tokens per expert since start and in the recent window."""
    blocks = []
    for layer, load in sorted(loads.items()):
        total = int(load.tokens_total.sum())
        top = float(load.tokens_total.max()) if load.tokens_total.size else 0.0
        rows = [
            [str(e), str(int(n)), f"{100.0 * n / total:.1f}%" if total else "-", str(int(r)), _bar(n, top)]
            for e, (n, r) in enumerate(zip(load.tokens_total, load.tokens_recent))
        ]
        imbalance = [_imbalance(load.tokens_total), _imbalance(load.tokens_recent)]
        shown = ["-" if v is None else f"{v:.2f}" for v in imbalance]
        blocks.append(
            f"layer {layer}: {total} tokens routed since start; recent = last {load.window_seconds:g} s\n"
            + _table(["expert", "total", "share", "recent", ""], rows, bar_last=True)
            + f"\nimbalance (max/mean): total {shown[0]}, recent {shown[1]}"
        )
    return "\n\n".join(blocks) if blocks else "no layers"


def import_pyplot():
    """matplotlib.pyplot on the file-only Agg backend; RuntimeError naming the extra when missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'expertd[plot]'") from None
    return plt


def write_load_plot(loads: dict[int, ExpertLoad], path: str, *, recent: bool = False) -> None:
    """A bar chart PNG of tokens per expert, one panel per layer."""
    plt = import_pyplot()
    layers = sorted(loads)
    if not layers:
        raise ValueError("--plot: the server reported no layers")
    figure, axes = plt.subplots(len(layers), 1, figsize=(max(6, 0.25 * loads[layers[0]].tokens_total.size),
                                                         2.6 * len(layers)), squeeze=False)
    for ax, layer in zip(axes[:, 0], layers):
        load = loads[layer]
        tokens = load.tokens_recent if recent else load.tokens_total
        ax.bar(np.arange(tokens.size), tokens, color="tab:blue")
        if tokens.size and tokens.mean() > 0:
            ax.axhline(tokens.mean(), color="tab:red", linewidth=1, label="mean")
            ax.legend(loc="upper right", fontsize=8)
        window = f"last {load.window_seconds:g} s" if recent else "since start"
        ax.set_title(f"layer {layer}: tokens per expert ({window})", fontsize=10)
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
