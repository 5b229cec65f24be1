"""``offload_moe``: swap every sparse-MoE block of a transformers model for a :class:`RemoteMoeBlock`,
after checking that the expert server holds those layers as the model has them.

The start check (GetModelInfo) compares, for every block of decoder layer i, the server's layer i
with the model's config: H, E, k, I, score function, groups, selection bias and shared experts
(:class:`~expertd.client.transformers.families.LayerSpec`). Any difference, or a layer the server
does not hold, raises :class:`LayerMismatchError` listing every problem; the model is then left
untouched.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from expertd.client.client import ExpertClient
from expertd.client.transformers.families import LayerSpec, MoEBlock, expected_layer, find_moe_blocks
from expertd.client.transformers.remote import RemoteMoeBlock


class LayerMismatchError(ValueError):
    """The expert server does not hold the model's MoE layers as the model has them.

    ``problems`` lists one line per mismatch (``"layer 3: num_experts: model 64, server 128"``).
    """

    def __init__(self, target: str, problems: list[str]):
        super().__init__(f"expert server {target} does not serve this model's MoE layers as the model has them:\n  "
                         + "\n  ".join(problems))
        self.problems = problems


@dataclasses.dataclass
class Offload:
    """What ``offload_moe`` did: the client it calls, and the remote blocks by decoder-layer index."""

    model: nn.Module
    client: ExpertClient
    blocks: dict[int, RemoteMoeBlock]
    paths: dict[int, str]
    owns_client: bool

    @property
    def layers(self) -> list[int]:
        """The decoder-layer indices whose MoE block is computed by the server, ascending."""
        return sorted(self.blocks)

    def restore(self) -> None:
        """Put the kept local blocks back in place of the remote ones (needs ``keep_local=True``)."""
        dropped = [index for index, block in self.blocks.items() if block.local is None]
        if dropped:
            raise RuntimeError(f"layers {dropped} were offloaded with keep_local=False: their local blocks are gone")
        for index, block in self.blocks.items():
            _replace(self.model, self.paths[index], block.local)
        self.blocks = {}

    def close(self) -> None:
        """Close the client if ``offload_moe`` created it."""
        if self.owns_client:
            self.client.close()

    def __enter__(self) -> Offload:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def offload_moe(model: nn.Module, target: str | ExpertClient, *, keep_local: bool = True, check: bool = True,
                timeout: float | None = 30.0, **client_options) -> Offload:
    """Replace every sparse-MoE block of ``model`` by a module that calls the expert server ``target``.

    Args:
      model: a loaded transformers model (``PreTrainedModel``) of a family in ``FAMILIES``, or one
        loaded by ``load_without_experts``.
      target: ``host:port`` of the server, or a client: an ExpertClient, or any object with its
        ``forward(x, *, layer)``, ``model_info()`` and ``target`` (not closed by ``Offload.close``).
      keep_local: keep each original block as the remote block's ``local`` child (its weights stay in
        memory; ``Offload.restore`` puts it back; router logits can be computed). False drops the
        router, routed and shared expert weights of every replaced block.
      check: compare the server's layers with the model's first (GetModelInfo); LayerMismatchError
        names every difference.
      timeout: per-call deadline in seconds when a client is created here.
      client_options: further ExpertClient arguments (retries, tls, token, ...) when ``target`` is a str.

    Returns:
      An :class:`Offload`: the blocks by decoder-layer index, ``restore()`` and ``close()``.
    """
    blocks = list(find_moe_blocks(model))
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no sparse-MoE block of a known family "
                         f"(expertd.client.transformers.FAMILIES lists them), or it was offloaded already")
    owns_client = isinstance(target, str)
    client = ExpertClient(target, timeout=timeout, **client_options) if owns_client else target
    try:
        if check:
            config = model.config.get_text_config()
            check_layers([expected_layer(block.family, config, block.index) for block in blocks],
                         client.model_info(), client.target)
        remote = {block.index: _remote(block, client, keep_local) for block in blocks}
    except BaseException:
        if owns_client:
            client.close()
        raise
    for block in blocks:
        _replace(model, block.path, remote[block.index])
    return Offload(model, client, remote, {block.index: block.path for block in blocks}, owns_client)


def check_layers(expected: list[LayerSpec], info, target: str) -> None:
    """Raise LayerMismatchError unless GetModelInfo's ``info`` holds every expected layer as expected."""
    served = {layer.index: layer for layer in info.layers}
    problems = []
    for spec in expected:
        layer = served.get(spec.index)
        if layer is None:
            problems.append(f"layer {spec.index}: not served (the server holds layers {sorted(served) or 'none'})")
        else:
            problems += [f"layer {spec.index}: {difference}" for difference in spec.differences(layer)]
    if problems:
        raise LayerMismatchError(target, problems)


def _remote(block: MoEBlock, client: ExpertClient, keep_local: bool) -> RemoteMoeBlock:
    kept = keep_local and any(True for _ in block.module.parameters())  # a placeholder holds nothing to keep
    return RemoteMoeBlock(client.forward, block.index, block.family, local=block.module if kept else None)


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
