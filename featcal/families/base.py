"""What the calibration driver needs to know about an architecture, behind one small interface.

A family says: which module is the shared backbone, its blocks in forward order, which modules
inside a block are calibrated (Linear, LayerNorm, RMSNorm), how the head pools, and how to run
the blocks one at a time on hidden states with exactly the inputs the full model would build.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from featcal.io.models import backbone_of

CALIBRATED_KINDS = ("linear", "layernorm", "rmsnorm")
KEY_VALUE_NAMES = frozenset({"key", "value", "k_proj", "v_proj", "k", "v"})


@dataclass
class Stream:
    """Hidden states entering a block, plus the other inputs the model passes to its blocks.

    `mask` marks real tokens (one moment row each); `pooled_index` is the token the task head
    reads ([B] positions), or None when the head mean-pools.
    """

    hidden: Tensor
    mask: Tensor
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    pooled_index: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def with_hidden(self, hidden: Tensor) -> "Stream":
        return replace(self, hidden=hidden)


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors inside tuples, lists and dicts moved to `device`; anything else as it is."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


class _StopForward(Exception):
    """Raised from a pre-hook to end a forward pass once a block's inputs are captured."""


def capture_block_call(block: nn.Module, run) -> tuple[tuple, dict]:
    """Run `run()` (a full forward) until `block` is called; return that call's args and kwargs.

    The blocks' extra inputs (4-D attention masks, rotary embeddings, ...) are built by the model
    itself, so the blocks run one at a time reproduce the full forward exactly.
    """
    captured: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        captured["args"], captured["kwargs"] = args, dict(kwargs)
        raise _StopForward

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    except _StopForward:
        pass
    finally:
        handle.remove()
    if "args" not in captured:
        raise RuntimeError(f"the forward pass never reached block {type(block).__name__}")
    return captured["args"], captured["kwargs"]


def module_kind(module: nn.Module) -> str | None:
    """'linear', 'layernorm', 'rmsnorm' or None (not calibrated)."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.LayerNorm):
        return "layernorm" if module.elementwise_affine else None
    name = type(module).__name__
    if "RMSNorm" in name or name == "T5LayerNorm":
        return "rmsnorm"
    return None


def first_output(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class Family:
    """Base family: blocks that all receive the same extra inputs, captured from the model."""

    name: str = "generic"
    model_types: tuple[str, ...] = ()
    pooling: str = "cls"  # "cls", "mean" or "last"

    def for_model(self, model: nn.Module) -> "Family":
        """The variant of this family for `model`'s task (Llama-like decoders: classifier or causal LM)."""
        return self

    # --- structure -------------------------------------------------------------------------
    def backbone(self, model: nn.Module) -> nn.Module:
        """The shared part that is merged and calibrated (task heads live outside it)."""
        return backbone_of(model)

    def blocks(self, backbone: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def depth(self, config: Any) -> int:
        """How many blocks `blocks` gives for a model of this config (read before any weight is)."""
        return int(config.num_hidden_layers)

    def calibrated_modules(self, block: nn.Module) -> dict[str, nn.Module]:
        """Qualified names (inside the block) → calibrated modules, in registration order."""
        return {n: m for n, m in block.named_modules() if n and module_kind(m) is not None}

    def is_key_value(self, module_name: str) -> bool:
        """Key/value projections keep all tokens' weight in the last layer (every token is attended)."""
        return module_name.rsplit(".", 1)[-1] in KEY_VALUE_NAMES

    def pooler(self, backbone: nn.Module) -> nn.Linear | None:
        """An optional dense layer after the last block that reads the pooled token."""
        return None

    def shared_block_prefixes(self, backbone: nn.Module) -> list[str]:
        """Parameter-name prefixes inside blocks that running any block needs (T5: block 0's
        relative position tables, whose biases every later block of the stack receives)."""
        return []

    def block_prefix(self, backbone: nn.Module, index: int) -> str:
        """The parameter-name prefix of block `index` inside the backbone's state dict."""
        target = self.blocks(backbone)[index]
        for name, module in backbone.named_modules():
            if module is target:
                return name + "."
        raise KeyError(index)

    # --- running ----------------------------------------------------------------------------
    def model_inputs(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The backbone's keyword inputs from a batch (labels and unknown keys dropped)."""
        return {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def token_mask(self, inputs: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        mask = inputs.get("attention_mask")
        if mask is None:
            return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        return mask.to(torch.bool)

    def pooled_index(self, mask: Tensor) -> Tensor | None:
        if self.pooling == "cls":
            return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
        if self.pooling == "last":
            return mask.long().sum(1) - 1
        return None

    @torch.no_grad()
    def enter(self, backbone: nn.Module, inputs: Mapping[str, Tensor]) -> Stream:
        """The stream entering block 0: embeddings output and the blocks' extra inputs."""
        model_inputs = self.model_inputs(inputs)
        args, kwargs = capture_block_call(self.blocks(backbone)[0], lambda: backbone(**model_inputs))
        hidden = args[0]
        mask = self.token_mask(inputs, hidden)
        return Stream(hidden, mask, tuple(args[1:]), kwargs, self.pooled_index(mask))

    @torch.no_grad()
    def run_block(self, backbone: nn.Module, index: int, stream: Stream, block: nn.Module | None = None) -> Stream:
        """Apply block `index` (or a stand-in `block` with the same structure) to the stream."""
        block = self.blocks(backbone)[index] if block is None else block
        return stream.with_hidden(first_output(block(stream.hidden, *stream.args, **stream.kwargs)))

    def carried(self, stream: Stream) -> dict[str, Tensor]:
        """Per-example tensors besides the hidden states that a stored stream must keep, so that
        `resume` can rebuild it (T5's decoder: the encoder output it cross-attends to)."""
        return {}

    def resume(self, backbone: nn.Module, index: int, like: Stream, hidden: Tensor,
               carried: Mapping[str, Tensor]) -> Stream:
        """The stream of `backbone` entering block `index`, from stored `hidden` states and `carried`
        tensors. `like` is a stream on the same batch entering block 0 or block `index` of any
        model of the family: its masks and pooled index are kept; what depends on the model (T5's
        position biases, its encoder output) is made from `backbone` and `carried`. Here every
        block receives the same extra inputs, whoever's they are."""
        return like.with_hidden(hidden)

    def row_mask(self, module_name: str, stream: Stream) -> Tensor:
        """Which rows of a module's captured input are real tokens."""
        return stream.mask

    def block_output(self, backbone: nn.Module, index: int, stream: Stream) -> tuple[Tensor, Tensor]:
        """Block `index`'s output and its real-token mask, given the stream `run_block` returned.

        The stream itself, except where running a block also moves on to the next stage (T5: after
        the last encoder block the stream is the decoder's input). What per-layer drift compares.
        """
        return stream.hidden, stream.mask

    def last_hidden_state(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """The backbone's output (`last_hidden_state`, [B, T, d]) from the stream the last block
        returned: what a head reading every token (a causal LM's) is given, when the blocks run one
        at a time. Families whose backbone ends in a final norm say so (Llama-like decoders)."""
        raise NotImplementedError(f"family {self.name!r}: the backbone's output from the last block's stream")

    def head_features(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """The representation after the last block that heads read ([B, d]); used for drift."""
        return pool(stream.hidden, stream.mask, stream.pooled_index)


def run_streams(family: Family, backbones: nn.Module | Mapping[str, nn.Module], index: int,
                streams: Mapping[str, list[Stream]]) -> dict[str, list[Stream]]:
    """Every task's streams through block `index` of `backbones` (one backbone, or one per task)."""
    def backbone(task: str) -> nn.Module:
        return backbones if isinstance(backbones, nn.Module) else backbones[task]

    return {t: [family.run_block(backbone(t), index, s) for s in ss] for t, ss in streams.items()}


def pool(hidden: Tensor, mask: Tensor, pooled_index: Tensor | None) -> Tensor:
    """The pooled token (CLS / last) or the masked mean over tokens."""
    if pooled_index is not None:
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), pooled_index]
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


# --- parameter names per block (the lazy, block-at-a-time drivers read checkpoints by these) ---


def block_prefixes(family: Family, backbone: nn.Module) -> list[str]:
    return [family.block_prefix(backbone, i) for i in range(len(family.blocks(backbone)))]


def outer_prefixes(family: Family, backbone: nn.Module) -> list[str]:
    """Parameter names outside every block (embeddings, final norms, pooler): each as a prefix."""
    inside = tuple(block_prefixes(family, backbone))
    return [n for n, _ in backbone.named_parameters(remove_duplicate=False) if not n.startswith(inside)]


def leaves_stage(family: Family, backbone: nn.Module, index: int) -> bool:
    """Whether running block `index` also runs parameters outside the blocks (T5: the last encoder
    block hands over to the decoder through the encoder's final norm and the decoder's embeddings)."""
    n_encoder = getattr(family, "n_encoder_blocks", None)
    decoder = getattr(family, "decoder", None)
    return (
        n_encoder is not None and decoder is not None and decoder(backbone) is not None
        and index == n_encoder(backbone) - 1
    )
