"""The user's own model for ``verify layout``: parameter shapes, a shapes file, or a
Megatron-style GPT description (``--num-layers``, ``--hidden-size``, ...).

Each source yields an object with ``name`` and ``param_numels()`` -> (numels,
shared-embedding indices, names), the interface ``padding_row`` reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify.options import SetOnce
from verify.studies.layout_models import ModelSpec


@dataclass(frozen=True)
class ShapeListModel:
    """A model given as its parameter shapes, in registration order."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    shared_embedding: tuple[int, ...] = ()
    names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError(f"model {self.name!r}: expected at least one parameter shape")
        for i, shape in enumerate(self.shapes):
            if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                                for d in shape):
                raise ValueError(f"model {self.name!r}: parameter {i} has shape {shape}; "
                                 "every dimension must be an int >= 1")
        for i in self.shared_embedding:
            if not 0 <= i < len(self.shapes):
                raise ValueError(f"model {self.name!r}: shared_embedding index {i} is not a "
                                 f"parameter index (0..{len(self.shapes) - 1})")
        if self.names and len(self.names) != len(self.shapes):
            raise ValueError(f"model {self.name!r}: {len(self.names)} names for "
                             f"{len(self.shapes)} shapes")

    def param_numels(self) -> tuple[list[int], list[int], list[str]]:
        """(numels, shared-embedding indices, names), registration order."""
        names = list(self.names) or [f"param{i}" for i in range(len(self.shapes))]
        return [math.prod(s) for s in self.shapes], list(self.shared_embedding), names


def parse_shapes(text: str, option: str = "--shapes") -> tuple[tuple[int, ...], ...]:
    """``4096x4096,4096,11008x4096`` -> ((4096, 4096), (4096,), (11008, 4096))."""
    shapes = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            shape = tuple(int(d) for d in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"{option}: {item!r} is not a shape such as 4096x4096 or 4096") from None
        if any(d < 1 for d in shape):
            raise ValueError(f"{option}: {item!r}: every dimension must be >= 1")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"{option}: expected at least one shape, e.g. 4096x4096,4096")
    return tuple(shapes)


def _shape_of(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        return parse_shapes(value, where)[0]
    if isinstance(value, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                       for d in value):
        return tuple(value)
    raise ValueError(f"{where}: {value!r} is not a shape (a list of ints, an int, or '4096x4096')")


def load_model_file(path: str | Path) -> ShapeListModel:
    """A JSON model file: a list of shapes, a ``{name: shape}`` object, or
    ``{"name": ..., "shapes": [...] or {...}, "shared_embedding": [0]}``."""
    option = "--model-file"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{option} {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} {path}: not valid JSON ({exc})") from None
    name, shared, names = Path(path).stem, (), ()
    if isinstance(data, dict) and "shapes" in data:
        name = str(data.get("name", name))
        shared = tuple(data.get("shared_embedding", ()))
        data = data["shapes"]
    if isinstance(data, dict):
        names = tuple(str(k) for k in data)
        shapes = tuple(_shape_of(v, f"{option} {path}: {k}") for k, v in data.items())
    elif isinstance(data, list):
        shapes = tuple(_shape_of(v, f"{option} {path}: item {i}") for i, v in enumerate(data))
    else:
        raise ValueError(f"{option} {path}: expected a list of shapes or an object")
    try:
        return ShapeListModel(name, shapes, shared, names)
    except ValueError as exc:
        raise ValueError(f"{option} {path}: {exc}") from None


GPT_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "padded_vocab_size")


def gpt_model(args: Any) -> ModelSpec | None:
    """The Megatron-style description in ``args`` as a ModelSpec; None when none was given."""
    given = [f for f in GPT_FLAGS if getattr(args, f, None) is not None]
    if not given:
        return None
    missing = [f for f in ("num_layers", "hidden_size", "padded_vocab_size") if f not in given]
    if missing:
        raise ValueError("a GPT-style model needs " + ", ".join(
            "--" + f.replace("_", "-") for f in missing))
    hidden = args.hidden_size
    ffn = args.ffn_hidden_size or 4 * hidden
    kv_total = hidden
    if args.num_query_groups is not None:
        if args.kv_channels is None:
            raise ValueError("--num-query-groups needs --kv-channels (channels per head)")
        kv_total = args.num_query_groups * args.kv_channels
    kind = args.position_embedding_type or (
        "learned_absolute" if args.max_position_embeddings else "rope")
    learned = args.max_position_embeddings if kind == "learned_absolute" else 0
    if kind == "learned_absolute" and not learned:
        raise ValueError("--position-embedding-type learned_absolute needs --max-position-embeddings")
    try:
        return ModelSpec("custom-gpt", hidden, args.num_layers, args.padded_vocab_size, ffn,
                         kv_total, args.swiglu, not args.disable_bias_linear,
                         args.normalization == "LayerNorm", learned or 0,
                         not args.untie_embeddings_and_output_weights)
    except ValueError as exc:
        flag_of = {"hidden": "--hidden-size", "layers": "--num-layers",
                   "vocab": "--padded-vocab-size", "ffn_hidden": "--ffn-hidden-size",
                   "kv_channels_total": "--num-query-groups x --kv-channels",
                   "learned_positions": "--max-position-embeddings"}
        message = str(exc)
        for field_name, flag in flag_of.items():
            message = message.replace(f"ModelSpec.{field_name} ", f"{flag} ")
        raise ValueError(message) from None


def add_model_arguments(parser: Any) -> None:
    """The options that describe the user's own model (each at most once)."""
    group = parser.add_argument_group(
        "your own model (instead of, or beside, --model)",
        "a list of parameter shapes, a JSON file of them, or a Megatron-style GPT description")
    group.add_argument("--shapes", action=SetOnce, metavar="SHAPES",
                       help="parameter shapes in registration order, e.g. 4096x4096,4096,...")
    group.add_argument("--shared-embedding", type=int, action="append", metavar="INDEX",
                       help="index of a --shapes parameter shared across stages (repeatable)")
    group.add_argument("--model-file", action=SetOnce, metavar="PATH",
                       help="JSON: a list of shapes, {name: shape}, or "
                            "{\"name\", \"shapes\", \"shared_embedding\"}")
    group.add_argument("--num-layers", action=SetOnce, type=int, metavar="N")
    group.add_argument("--hidden-size", action=SetOnce, type=int, metavar="H")
    group.add_argument("--ffn-hidden-size", action=SetOnce, type=int, metavar="F", help="default 4 x H")
    group.add_argument("--padded-vocab-size", action=SetOnce, type=int, metavar="V")
    group.add_argument("--num-query-groups", action=SetOnce, type=int, metavar="G", help="GQA: KV head groups")
    group.add_argument("--kv-channels", action=SetOnce, type=int, metavar="C", help="channels per attention head")
    group.add_argument("--swiglu", action="store_true", help="gated MLP (fc1 holds two matrices)")
    group.add_argument("--disable-bias-linear", action="store_true", help="no linear biases")
    group.add_argument("--normalization", action=SetOnce, choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    group.add_argument("--position-embedding-type", action=SetOnce, choices=("learned_absolute", "rope"),
                       default=None, help="default: learned_absolute with "
                       "--max-position-embeddings, else rope")
    group.add_argument("--max-position-embeddings", action=SetOnce, type=int, metavar="S", default=None)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")


def user_models(args: Any) -> list[Any]:
    """Every user model the options describe (ValueErrors name the flag at fault)."""
    models: list[Any] = []
    if args.shapes:
        models.append(ShapeListModel("shapes", parse_shapes(args.shapes),
                                     tuple(args.shared_embedding or ())))
    elif args.shared_embedding:
        raise ValueError("--shared-embedding needs --shapes")
    if args.model_file:
        models.append(load_model_file(args.model_file))
    gpt = gpt_model(args)
    if gpt is not None:
        models.append(gpt)
    return models


def model_rows(models: Sequence[Any], dps: Sequence[int], padding_row: Any, **kwargs: Any) -> list:
    """``padding_row`` for every (model, dp, high-busbw off/on)."""
    return [padding_row(m, dp, hb, **kwargs) for m in models for dp in dps for hb in (False, True)]
