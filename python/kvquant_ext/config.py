"""Compression configs (frozen, validated dataclasses), the format registry and named presets.

A config is plain data.  What compresses a block or streams tokens for it is the *format*
registered against its class (:func:`register_format`): the modules that implement a method
(``streams``, ``gear``, ``hqmq``) register theirs when imported, and
:func:`kvquant_ext.compress` / :class:`kvquant_ext.KVCache` look the format up by config
type, so they never special-case methods and this module imports none of them.  C++ only
ever receives ints and floats taken from these objects.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, Optional, Tuple, Type

from ._build_config import BITS, BITS_TEXT

ROLES = ("key", "value")

_REGISTRY: Dict[str, Type["CompressionConfig"]] = {}


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"argument 'role' must be 'key' or 'value', got {role!r}")
    return role


# ----------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class Format:
    """How one config class is compressed and streamed.

    ``compress(x, config, role, *, layer_idx, check_finite, **options)`` returns a
    :class:`~kvquant_ext.Compressed` for one whole ``[B, H, T, D]`` block;
    ``new_stream(config, role, *, layer_idx, check_finite)`` returns an empty
    :class:`~kvquant_ext.streams.Stream`.  ``role`` arrives validated; ``layer_idx`` is
    passed to every format (formats whose storage does not depend on the layer ignore it).
    """

    compress: Callable
    new_stream: Callable


_FORMATS: Dict[type, Format] = {}


def register_format(config_cls: type, *, compress: Callable, new_stream: Callable) -> None:
    """Register (or replace) the :class:`Format` of ``config_cls`` and its subclasses
    (a subclass's own registration wins)."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, CompressionConfig)):
        raise TypeError(f"argument 'config_cls' must be a CompressionConfig subclass, got {config_cls!r}")
    for name, f in (("compress", compress), ("new_stream", new_stream)):
        if not callable(f):
            raise TypeError(f"argument '{name}' must be callable, got {type(f).__name__}")
    _FORMATS[config_cls] = Format(compress, new_stream)


def format_of(config: "CompressionConfig") -> Format:
    """The :class:`Format` registered for ``type(config)`` or its nearest base class."""
    for cls in type(config).__mro__:
        fmt = _FORMATS.get(cls)
        if fmt is not None:
            return fmt
    raise TypeError(f"no compression format is registered for {type(config).__name__}; "
                    "register one with kvquant_ext.register_format")


# ----------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class QuantSpec:
    """How one role is group-quantized: bits, group size (-1 = whole axis), grouping."""

    bits: int
    group_size: int
    per_channel: bool

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"argument 'bits' must be {BITS_TEXT}, got {self.bits}")
        if not (self.group_size == -1 or self.group_size > 0):
            raise ValueError(f"argument 'group_size' must be positive or -1, got {self.group_size}")
        if not self.per_channel and self.group_size != -1:
            g = self.group_size
            if g < 8 or g & (g - 1):
                raise ValueError(
                    f"argument 'group_size' must be a power of two >= 8 for per-token grouping, got {g}")


def _check_common_fields(config: "CompressionConfig") -> None:
    """Validate the fields every config has (``recent_window``, ``skip_layers``)."""
    W = config.recent_window
    if isinstance(W, bool) or not isinstance(W, int) or W < 0:
        raise ValueError(f"argument 'recent_window' must be an int >= 0, got {W!r}")
    sk = config.skip_layers
    if not isinstance(sk, (tuple, list)) or any(isinstance(i, bool) or not isinstance(i, int) for i in sk) \
            or len(set(sk)) != len(sk):
        raise ValueError(f"argument 'skip_layers' must be a tuple of distinct layer indices (ints; "
                         f"negative ones count from the last layer), got {sk!r}")
    object.__setattr__(config, "skip_layers", tuple(sk))


@dataclass(frozen=True)
class CompressionConfig:
    """Base of every config: its dataclass fields are the whole config (``to_dict`` /
    ``from_dict`` round-trip them); behaviour comes from the registered :class:`Format`.

    ``skip_layers`` (keyword only, every method): layer indices a streaming cache keeps in
    full precision (negative ones count from the last layer), as serving engines keep e.g. the
    first and last layers; :meth:`skips_layer` resolves them.

    ``recent_window`` (keyword only, every method): a streaming cache keeps the newest W
    tokens of every layer in full precision; a token that ages out of the window enters the
    method's own streaming rule (KIVI's residual and block flush, GEAR's buffer and blocks,
    HQMQ's per-token encoding), so the method's own full-precision tokens come on top.  The
    window's tokens are stored, and counted in ``nbytes``, in the cache dtype.  A whole block
    compressed with :func:`kvquant_ext.compress` ignores it."""

    version: ClassVar[int] = 1
    method: ClassVar[str] = "base"
    recent_window: int = dataclasses.field(default=0, kw_only=True)
    skip_layers: Tuple[int, ...] = dataclasses.field(default=(), kw_only=True)

    def skips_layer(self, layer_idx: int, num_layers: Optional[int]) -> bool:
        """Is layer ``layer_idx`` kept in full precision (``skip_layers``; a negative entry
        counts from the last of ``num_layers`` layers, which must then be known)?"""
        if not self.skip_layers:
            return False
        if num_layers is None:
            if any(i < 0 for i in self.skip_layers):
                raise ValueError(f"argument 'num_layers' is needed to resolve the negative entries of "
                                 f"skip_layers={self.skip_layers}")
            return layer_idx in self.skip_layers
        return any(i % num_layers == layer_idx for i in self.skip_layers if -num_layers <= i < num_layers)

    def __post_init__(self):
        _check_common_fields(self)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _REGISTRY[cls.__name__] = cls

    # -- behaviour (the registered format) ----------------------------------------
    def compress(self, x, role: str, *, check_finite: bool = True, layer_idx: int = 0,
                 **options):
        """Compress one whole ``[B, H, T, D]`` block as ``role``; ``options`` go to the
        format (e.g. GEAR's ``rank``)."""
        return format_of(self).compress(x, self, _check_role(role), layer_idx=layer_idx,
                                        check_finite=check_finite, **options)

    def new_stream(self, role: str, *, check_finite: bool = True, layer_idx: int = 0):
        """An empty stream of ``role`` for layer ``layer_idx`` of a cache."""
        return format_of(self).new_stream(self, _check_role(role), layer_idx=layer_idx,
                                          check_finite=check_finite)

    # -- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["__class__"] = type(self).__name__
        d["__version__"] = self.version
        return d

    @staticmethod
    def from_dict(d: dict) -> "CompressionConfig":
        d = dict(d)
        cls = _REGISTRY[d.pop("__class__")]
        d.pop("__version__", None)
        return cls(**d)


@dataclass(frozen=True)
class FP16Config(CompressionConfig):
    """No compression: tokens are kept in their input dtype (the reference)."""

    method: ClassVar[str] = "fp16"


@dataclass(frozen=True)
class GroupQuantBase(CompressionConfig):
    """Asymmetric group quantization of keys and values with a full-precision residual
    window of ``residual_length`` tokens (KIVI's streaming rule).  Subclasses define the
    field ``residual_length`` and :meth:`key_spec` / :meth:`value_spec`.

    Per-channel roles use the block-flush rule (buffer of R tokens, quantized when full);
    per-token roles use a FIFO of the last R tokens."""

    method: ClassVar[str] = "group"

    def __post_init__(self):
        _check_common_fields(self)
        ks, vs = self.key_spec(), self.value_spec()  # validates
        R = self.residual_length
        if isinstance(R, bool) or not isinstance(R, int) or R < 0:
            raise ValueError(f"argument 'residual_length' must be an int >= 0, got {R!r}")
        for spec, role in ((ks, "key"), (vs, "value")):
            if spec.per_channel:
                if R == 0:
                    raise ValueError(
                        f"argument 'residual_length' must be > 0 with per-channel {role}s "
                        "(tokens are quantized R at a time)")
                if spec.group_size != -1 and R % spec.group_size:
                    raise ValueError(
                        f"argument 'residual_length' ({R}) must be a multiple "
                        f"of the {role} group size ({spec.group_size})")

    def key_spec(self) -> QuantSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def value_spec(self) -> QuantSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def spec(self, role: str) -> QuantSpec:
        return self.key_spec() if _check_role(role) == "key" else self.value_spec()


@dataclass(frozen=True)
class GroupQuantConfig(GroupQuantBase):
    """Generic group quantization: every grouping parameter of keys and values explicit."""

    bits: int = 4
    key_group_size: int = 32
    value_group_size: int = 32
    key_per_channel: bool = True
    value_per_channel: bool = False
    residual_length: int = 128

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.key_group_size, self.key_per_channel)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.value_group_size, self.value_per_channel)


@dataclass(frozen=True)
class KIVIConfig(GroupQuantBase):
    """KIVI: per-channel keys (G tokens), per-token values (G channels), residual R."""

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    method: ClassVar[str] = "kivi"

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size, True)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size, False)


@dataclass(frozen=True)
class KCVTConfig(GroupQuantBase):
    """KCVT: one scale/zero per whole key channel and per whole value token."""

    bits: int = 4
    residual_length: int = 128
    method: ClassVar[str] = "kcvt"

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, -1, True)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, -1, False)


@dataclass(frozen=True)
class PerTokenIntConfig(GroupQuantBase):
    """Naive per-token INT-b: one asymmetric scale/zero per token vector, keys and values,
    every token quantized on arrival (no residual by default)."""

    bits: int = 4
    residual_length: int = 0
    method: ClassVar[str] = "int-per-token"

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, -1, False)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, -1, False)


@dataclass(frozen=True)
class FlexGenConfig(GroupQuantBase):
    """FlexGen-style: per-token groups of ``group_size`` channels for keys and values."""

    bits: int = 4
    group_size: int = 64
    residual_length: int = 0
    method: ClassVar[str] = "flexgen"

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size, False)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size, False)


# ----------------------------------------------------------------------------- presets
PRESETS: Dict[str, CompressionConfig] = {
    "fp16": FP16Config(),
    "kivi-2": KIVIConfig(bits=2, group_size=32, residual_length=128),
    "kivi-4": KIVIConfig(bits=4, group_size=32, residual_length=128),
    "kcvt-4": KCVTConfig(bits=4, residual_length=128),
    "int4-per-token": PerTokenIntConfig(bits=4),
    "int2-per-token": PerTokenIntConfig(bits=2),
    "flexgen-4": FlexGenConfig(bits=4, group_size=64),
}


def register_preset(name: str, config: CompressionConfig) -> None:
    """Add (or replace) a named preset."""
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"argument 'config' must be a CompressionConfig, got {type(config).__name__}")
    PRESETS[name] = config


def get_config(name: str) -> CompressionConfig:
    """Return the preset called ``name`` (see ``kvq.PRESETS``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"argument 'name': unknown preset {name!r}; known: {sorted(PRESETS)}") from None


# ----------------------------------------------------------------------------- HQMQ
@dataclass(frozen=True)
class HQMQConfig(CompressionConfig):
    """HQMQ: Hurwitz quaternion multiplicative quantization of every 4-element chunk
    (direction: nearest of 24 x ``secondary_size`` codewords p.s; radius: ``radius_bits``
    uniform against the token's largest non-outlier chunk radius), optionally with Med3x
    outliers (``outlier_factor`` x the per-head median chunk norm, stored exactly).

    Keys and values are treated alike; every token is encoded on arrival.  The secondary
    sets differ per (layer, KV head, role) and derive from ``seed`` (see
    :func:`kvquant_ext.hqmq_seed`).
    """

    secondary_size: int = 96
    radius_bits: int = 4
    outlier_factor: Optional[float] = None
    seed: int = 0
    method: ClassVar[str] = "hqmq"

    def __post_init__(self):
        _check_common_fields(self)
        s, b, f = self.secondary_size, self.radius_bits, self.outlier_factor
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 2048:
            raise ValueError(f"argument 'secondary_size' must be an int in 1..2048, got {s!r}")
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
            raise ValueError(f"argument 'radius_bits' must be an int in 1..8, got {b!r}")
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not math.isfinite(f) or f <= 0):
            raise ValueError(f"argument 'outlier_factor' must be None or a finite number > 0, got {f!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"argument 'seed' must be a non-negative int, got {self.seed!r}")


# hqmq-3.79 keeps its newest 32 tokens in full precision: on the real-model eval (SmolLM2-135M,
# 1024 + 256 streamed tokens) that cut the streaming KL by 40% for 0.3 bits/element, a point on
# the (bits, KL) front; the paper's configuration, every token encoded, is hqmq-3.79-paper.
PRESETS["hqmq-3.79"] = HQMQConfig(secondary_size=96, radius_bits=4, recent_window=32)
PRESETS["hqmq-3.79-paper"] = HQMQConfig(secondary_size=96, radius_bits=4)
PRESETS["hqmq-5"] = HQMQConfig(secondary_size=192, radius_bits=6, outlier_factor=3.0)


# ----------------------------------------------------------------------------- GEAR
@dataclass(frozen=True)
class GEARConfig(CompressionConfig):
    """GEAR (Kang et al. 2024): quantized backbone + exact sparse outliers + low-rank
    residual, streamed with a full-precision buffer of ``buffer_length`` tokens.

    Parameters
    ----------
    bits : backbone bits (2, 4 or 8).
    group_size : KIVI group size G (tokens per key-channel group, channels per value-token
        group); ignored by the "kcvt" backbone (whole key channel / whole value token).
    sparsity : s in [0, 0.5): per vector the ceil(s/2 * L) largest and as many smallest
        entries are kept exactly.  0 gives GEAR-L.
    rank : rank of the residual factors of a prefill block (0: outlier-aware quantization).
    rank_decode : rank of the factors of each streamed decode block.
    iters : power iterations.
    buffer_length : n_b, decode tokens kept in full precision before being compressed as
        one block (a multiple of G with the KIVI backbone).
    backbone : "kivi" (per-channel keys / per-token values, groups of G) or "kcvt".
    seed : seed of the power iteration's start vectors.
    """

    bits: int = 2
    group_size: int = 64
    sparsity: float = 0.02
    rank: int = 4
    rank_decode: int = 2
    iters: int = 8
    buffer_length: int = 64
    backbone: str = "kivi"
    seed: int = 0
    method: ClassVar[str] = "gear"

    def __post_init__(self):
        _check_common_fields(self)
        if self.backbone not in ("kivi", "kcvt"):
            raise ValueError(f"argument 'backbone' must be 'kivi' or 'kcvt', got {self.backbone!r}")
        self.key_spec()  # validates bits / group_size
        self.value_spec()
        if not (isinstance(self.sparsity, (int, float)) and 0.0 <= self.sparsity < 0.5):
            raise ValueError(f"argument 'sparsity' must be in [0, 0.5), got {self.sparsity!r}")
        for name in ("rank", "rank_decode"):
            r = getattr(self, name)
            if not (isinstance(r, int) and 0 <= r <= 8):
                raise ValueError(f"argument '{name}' must be an int in [0, 8], got {r!r}")
        if not (isinstance(self.iters, int) and self.iters >= 1):
            raise ValueError(f"argument 'iters' must be an int >= 1, got {self.iters!r}")
        if not (isinstance(self.buffer_length, int) and self.buffer_length >= 1):
            raise ValueError(f"argument 'buffer_length' must be an int >= 1, got {self.buffer_length!r}")
        if self.backbone == "kivi" and self.buffer_length % self.group_size:
            raise ValueError(f"argument 'buffer_length' ({self.buffer_length}) must be a multiple of "
                             f"'group_size' ({self.group_size}) with the KIVI backbone")
        if self.rank_decode > self.buffer_length:
            raise ValueError(f"argument 'rank_decode' ({self.rank_decode}) must be <= "
                             f"'buffer_length' ({self.buffer_length})")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"argument 'seed' must be a non-negative int, got {self.seed!r}")

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size if self.backbone == "kivi" else -1, True)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size if self.backbone == "kivi" else -1, False)

    def spec(self, role: str) -> QuantSpec:
        return self.key_spec() if _check_role(role) == "key" else self.value_spec()



# The 2-bit (KIVI-backbone) presets stream in decode blocks of n_b = 128 tokens: against the
# paper's 64, the streaming KL drops for every 2-bit variant at equal or fewer bits/element on
# both eval models (docs/eval.md); gear-2-paper keeps the paper's n_b = 64 and the reference's
# 3 power iterations.
PRESETS["gear-2"] = GEARConfig(bits=2, group_size=64, sparsity=0.02, rank=4, rank_decode=2,
                               iters=8, buffer_length=128, backbone="kivi")
PRESETS["gear-2-paper"] = GEARConfig(bits=2, group_size=64, sparsity=0.02, rank=4, rank_decode=2,
                                     iters=3, buffer_length=64, backbone="kivi")
PRESETS["gear-4"] = GEARConfig(bits=4, sparsity=0.02, rank=4, rank_decode=2, iters=8,
                               buffer_length=20, backbone="kcvt")
PRESETS["gearl-2"] = GEARConfig(bits=2, group_size=64, sparsity=0.0, rank=4, rank_decode=2,
                                iters=8, buffer_length=128, backbone="kivi")
PRESETS["gearl-4"] = GEARConfig(bits=4, sparsity=0.0, rank=4, rank_decode=2, iters=8,
                                buffer_length=20, backbone="kcvt")
PRESETS["outlier-2"] = GEARConfig(bits=2, group_size=64, sparsity=0.02, rank=0, rank_decode=0,
                                  iters=3, buffer_length=128, backbone="kivi")
