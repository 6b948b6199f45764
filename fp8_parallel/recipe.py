"""FP8 formats and scaling recipes: plain, mutable configuration, as TransformerEngine's.

The names follow TransformerEngine's `transformer_engine.common.recipe`, so `from fp8_parallel import recipe`
stands in for `from transformer_engine.common import recipe`: `Format` (whose values carry `max_fwd` /
`max_bwd`), `DelayedScaling`, `Float8CurrentScaling` (our `CurrentScaling`), `MMParams`, `QParams`, and the
`Recipe` base with its kind predicates. The recipes' fields, their order and defaults are TransformerEngine's.
TransformerEngine fields that select behaviour we do not implement are accepted at their defaults and
refused, with the reason, at any other value. Its block-scaled recipes exist as names that refuse to be
constructed and say what to use instead. As in TransformerEngine, a recipe's fields may be assigned
(`recipe.margin = 1`); each `autocast` entry takes a validated snapshot (`snapshot`), which keys its scope, so
changing a recipe between steps is safe and never makes two different settings share one scope.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Callable, Dict, NamedTuple, Optional, Union

import torch

__all__ = [
    "CurrentScaling",
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
    "fp8_max",
    "snapshot",
]

AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
""""max" (max over the history), "most_recent" (the newest amax), or a callable mapping the history in
TransformerEngine's layout, `[history_len, num_tensors]` with the newest amaxes in row 0, to `[num_tensors]`
amaxes (e.g. `lambda h: h.max(dim=0).values`). The modules store the history transposed (`amax_history` is
`[num_tensors, history_len]`, newest in column 0)."""

_ALGOS = ("max", "most_recent")



BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")  # `backward_override` values, as in TransformerEngine

class FormatMax(NamedTuple):
    """A `Format`'s value: the largest finite forward and backward values (TransformerEngine's layout)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """Which FP8 encodings are used in the forward and the backward pass. Each value is a `FormatMax`
    (`Format.HYBRID.value.max_bwd == 57344`), as in TransformerEngine."""

    E2M1 = FormatMax(6.0, 6.0)  # FP4: a valid name, but no recipe here uses it
    E4M3 = FormatMax(448.0, 448.0)  # E4M3 everywhere
    E5M2 = FormatMax(57344.0, 57344.0)  # E5M2 everywhere: a valid name, but no recipe trains with it (nor in TE)
    HYBRID = FormatMax(448.0, 57344.0)  # E4M3 forward (activations, weights), E5M2 backward (gradients)

    @property
    def forward_dtype(self) -> torch.dtype:
        """The FP8 dtype of forward tensors (inputs, weights)."""
        if self is Format.E2M1:
            raise ValueError("Format.E2M1 is FP4, not an FP8 format")
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """The FP8 dtype of backward tensors (output gradients)."""
        if self is Format.E2M1:
            raise ValueError("Format.E2M1 is FP4, not an FP8 format")
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    @property
    def forward_max(self) -> float:
        """Largest finite forward value (TransformerEngine's `max_fwd`)."""
        return fp8_max(self.forward_dtype)

    @property
    def backward_max(self) -> float:
        """Largest finite backward value (TransformerEngine's `max_bwd`)."""
        return fp8_max(self.backward_dtype)


_FP8_MAX: Dict[torch.dtype, float] = {}  # computed once per dtype: this is called on every cast


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    value = _FP8_MAX.get(dtype)
    if value is None:
        value = _FP8_MAX[dtype] = float(torch.finfo(dtype).max)
    return value


@dataclasses.dataclass(frozen=True)
class MMParams:
    """Options of one FP8 GEMM, as TransformerEngine names them.

    `use_split_accumulator=False` is cuBLAS's fast accumulation (partial sums kept in the tensor cores'
    reduced precision for a while); True accumulates in full float32. Our GEMMs use fast accumulation for
    the forward GEMM and full accumulation for both backward GEMMs, which are TransformerEngine's defaults;
    recipes refuse other settings.
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.use_split_accumulator, bool):
            raise ValueError(f"use_split_accumulator={self.use_split_accumulator!r} must be a bool")


_FPROP_MM, _GRAD_MM = MMParams(use_split_accumulator=False), MMParams(use_split_accumulator=True)


@dataclasses.dataclass(frozen=True)
class QParams:
    """Quantization options of one tensor kind, as TransformerEngine names them (`Float8CurrentScaling`'s
    `fp8_quant_fwd_inp`, `fp8_quant_fwd_weight`, `fp8_quant_bwd_grad` report them). Only the defaults are
    implemented: scales are not rounded to powers of two, no Hadamard transform, no stochastic rounding."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    """Base of the FP8 recipes. The class predicates say which kind a recipe is (TransformerEngine's
    `recipe.delayed()`, `recipe.float8_current_scaling()`, ...); only per-tensor scaling exists here."""

    @classmethod
    def delayed(cls) -> bool:
        """Delayed scaling (scales from an amax history)."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """Per-tensor current scaling (scales from the tensor being cast)."""
        return issubclass(cls, CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """One scale per tensor (delayed or current)."""
        return issubclass(cls, (DelayedScaling, CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """Block-scaled FP8 (not implemented here: always False)."""
        return False

    @classmethod
    def mxfp8(cls) -> bool:
        """MXFP8 (not implemented here: always False)."""
        return False

    @classmethod
    def nvfp4(cls) -> bool:
        """NVFP4 (not implemented here: always False)."""
        return False

    @classmethod
    def custom(cls) -> bool:
        """A custom quantizer recipe (not implemented here: always False)."""
        return False


def _check_format(fmt: Any) -> None:
    if fmt is Format.E2M1:
        raise ValueError("fp8_format=Format.E2M1 is FP4 (NVFP4BlockScaling, not implemented); use Format.HYBRID "
                         "or Format.E4M3")
    if fmt is Format.E5M2:
        raise ValueError(
            "fp8_format=Format.E5M2: training with E5M2 everywhere is not supported (nor in TransformerEngine); "
            "use Format.HYBRID (E4M3 forward, E5M2 backward) or Format.E4M3"
        )
    if not isinstance(fmt, Format):
        raise ValueError(
            f"fp8_format={fmt!r} must be an fp8_parallel.recipe.Format (E4M3 or HYBRID); "
            "a TransformerEngine Format is not accepted: import recipes from fp8_parallel.recipe"
        )


def _check_common(recipe: Any) -> None:
    """The TransformerEngine fields both recipes share: FP8 attention and the backward override."""
    for name in ("fp8_dpa", "fp8_mha"):
        value = getattr(recipe, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be a bool")
        if value:
            raise NotImplementedError(
                f"{name}=True: FP8 attention is not implemented; attention runs in high precision and only the "
                f"linear layers run in FP8. Leave {name}=False."
            )
    if recipe.backward_override not in BACKWARD_OVERRIDES:
        raise ValueError(
            f"backward_override={recipe.backward_override!r}: expected one of {BACKWARD_OVERRIDES} (None: the "
            "backward GEMMs in FP8; 'high_precision': from the forward's high-precision input and weight; "
            "'dequantized': from their FP8 casts, dequantized; the gradient in high precision in both)"
        )


@dataclasses.dataclass(unsafe_hash=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor's scale comes from a history of past amaxes (TransformerEngine's rule).

    `scale = fp8_max / amax / 2**margin`, with `amax` taken from the history by `amax_compute_algo`.
    An amax that is <= 0, inf or NaN keeps the previous scale; a scale that overflows becomes float32 max.

    Args:
        margin: extra power-of-two headroom (a non-negative integer).
        fp8_format: E4M3 or HYBRID.
        amax_history_len: how many past amaxes each tensor keeps.
        amax_compute_algo: "max", "most_recent", or a callable taking the history in TransformerEngine's
            layout, `[history_len, num_tensors]` with the newest amaxes in row 0, and returning `[num_tensors]`
            amaxes (e.g. `lambda h: h.max(dim=0).values`; another shape is an error naming it). Part of the
            recipe's identity: two recipes that differ only here are different autocast scope keys.
        scaling_factor_compute_algo: None (the rule above) or a callable `(amax, scale, fp8_max, recipe)` ->
            new scales, as in TransformerEngine: `amax` and `scale` are `[num_tensors]` float32 (the amaxes taken
            from the history and the current scales), `fp8_max` the format's largest value (a float); it must
            return `[num_tensors]` scales. Tensors whose amax is 0 or not finite keep their scale whatever it
            returns.
        reduce_amax: all-reduce (MAX) amaxes over the scope's group before updating.
        fp8_dpa, fp8_mha: only False (no FP8 attention).
        backward_override: None (the backward GEMMs in FP8), "high_precision" (TransformerEngine's: input and
            weight gradients from the forward's high-precision input and weight, with the high-precision
            gradient) or "dequantized" (the same from their FP8 casts, dequantized).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    scaling_factor_compute_algo: Optional[Callable[..., torch.Tensor]] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (construction does, and so does each autocast entry: fields may be reassigned).

        Raises:
            ValueError / NotImplementedError: naming the field and its value.
        """
        _check_format(self.fp8_format)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin={self.margin!r} must be a non-negative integer")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len!r} must be a positive integer")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in _ALGOS:
            raise ValueError(f"amax_compute_algo={algo!r} must be one of {_ALGOS} or a callable")
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise ValueError(f"scaling_factor_compute_algo={sf!r} must be None or a callable "
                             "(amax, scale, fp8_max, recipe) -> scale")
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"reduce_amax={self.reduce_amax!r} must be a bool")
        _check_common(self)


@dataclasses.dataclass(unsafe_hash=True)
class CurrentScaling(Recipe):
    """Current (just-in-time) scaling: each cast takes its scale from the tensor being cast, no history.

    `scale = fp8_max / max(amax, eps)`, the same as torchao.float8's tensorwise dynamic scaling. No amax is
    registered with the autocast scope: each cast needs its scale before it runs, so each rank scales from
    its local tensor. `Float8CurrentScaling` is the same class under TransformerEngine's name; the fields
    are TransformerEngine's, in its order, and then `eps`.

    Args:
        use_power_2_scales: only False.
        fp8_format: E4M3 or HYBRID.
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: the GEMM options, only at TransformerEngine's
            defaults (fast accumulation forward, full float32 accumulation backward; see `MMParams`).
        fp8_dpa, fp8_mha: only False (no FP8 attention).
        backward_override: None (the backward GEMMs in FP8), "high_precision" (TransformerEngine's: input and
            weight gradients from the forward's high-precision input and weight, with the high-precision
            gradient) or "dequantized" (the same from their FP8 casts, dequantized).
        eps: lower bound of the amax (keeps an all-zero tensor's scale finite; TransformerEngine's
            `amax_epsilon` is 0 and treats a zero amax apart, with the same FP8 result: zeros).
    """

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = _FPROP_MM
    fp8_gemm_dgrad: MMParams = _GRAD_MM
    fp8_gemm_wgrad: MMParams = _GRAD_MM
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    eps: float = 1e-12

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (construction does, and so does each autocast entry: fields may be reassigned).

        Raises:
            ValueError / NotImplementedError: naming the field and its value.
        """
        _check_format(self.fp8_format)
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r} must be positive")
        if self.use_power_2_scales:
            raise NotImplementedError(
                "use_power_2_scales=True is not supported: scales are fp8_max / amax, not rounded to powers of two. "
                "Leave it False."
            )
        for name, expected in (("fp8_gemm_fprop", _FPROP_MM), ("fp8_gemm_dgrad", _GRAD_MM), ("fp8_gemm_wgrad", _GRAD_MM)):
            value = getattr(self, name)
            if not isinstance(value, MMParams):
                raise ValueError(f"{name}={value!r} must be an fp8_parallel.recipe.MMParams")
            if value != expected:
                raise NotImplementedError(
                    f"{name}={value!r} is not supported: the forward GEMM uses fast accumulation and the backward "
                    f"GEMMs accumulate in float32 (TransformerEngine's defaults). Use {name}={expected!r}."
                )
        _check_common(self)

    @property
    def reduce_amax(self) -> bool:
        """Always False: current scaling has no amaxes to reduce."""
        return False

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        """How inputs are quantized (TransformerEngine's attribute): `QParams()`."""
        return QParams()

    @property
    def fp8_quant_fwd_weight(self) -> QParams:
        """How weights are quantized (TransformerEngine's attribute): `QParams()`."""
        return QParams()

    @property
    def fp8_quant_bwd_grad(self) -> QParams:
        """How gradients are quantized (TransformerEngine's attribute): `QParams()`."""
        return QParams()


Float8CurrentScaling = CurrentScaling
"""TransformerEngine's name for `CurrentScaling`."""


_SNAPSHOT = "_fp8p_snapshot"  # on a user's recipe: (its field values, the snapshot taken of them)


def snapshot(recipe: Recipe) -> Recipe:
    """A validated copy of `recipe` as it is now, the one an autocast scope keeps and keys by.

    The same object comes back while the recipe's fields keep their values, so the modules' per-recipe
    preparation is not redone every step; after a field is reassigned, a new copy (a new scope key).

    Raises:
        ValueError / NotImplementedError: a field was set to a value the recipe refuses (naming it).
    """
    if isinstance(recipe, _UnavailableRecipe):
        recipe.validate()  # raises, naming the recipe
    values = tuple(getattr(recipe, f.name) for f in dataclasses.fields(recipe))
    cached = recipe.__dict__.get(_SNAPSHOT)
    if cached is not None and _same_values(cached[0], values):
        return cached[1]
    recipe.validate()
    copied = copy.copy(recipe)
    copied.__dict__.pop(_SNAPSHOT, None)
    copied.__dict__[_SNAPSHOT] = (values, copied)  # a snapshot is its own snapshot
    recipe.__dict__[_SNAPSHOT] = (values, copied)
    return copied


def _same_values(a: tuple, b: tuple) -> bool:
    """Field values equal, callables compared by identity (a new lambda is a new rule)."""
    return len(a) == len(b) and all(x is y or (not callable(x) and type(x) is type(y) and x == y) for x, y in zip(a, b))


def _answers(name: str) -> classmethod:
    """TE's predicate `name` for an unavailable recipe: True for the class whose `predicate` it is."""
    return classmethod(lambda cls: cls.predicate == name)


class _UnavailableRecipe(Recipe):
    """A TransformerEngine recipe this package does not implement. It is constructed with TransformerEngine's
    arguments (kept, and readable as attributes), as TE constructs it on a GPU that lacks the format (MXFP8
    on Hopper), and it is refused where it would be used: an autocast scope (or anything else that takes a
    recipe) raises NotImplementedError naming it and what to use."""

    format_name = "this format"
    predicate = ""  # the one of TE's predicates (`mxfp8`, ...) that answers True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.options = args, dict(kwargs)

    float8_block_scaling = _answers("float8_block_scaling")
    mxfp8 = _answers("mxfp8")
    nvfp4 = _answers("nvfp4")
    custom = _answers("custom")

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.options.items()]
        return f"{type(self).__name__}({', '.join(parts)})"

    def validate(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: {self.format_name} is not implemented in fp8_parallel (only per-tensor FP8 "
            "scaling is). Use recipe.DelayedScaling() or recipe.Float8CurrentScaling()."
        )


class MXFP8BlockScaling(_UnavailableRecipe):
    """Not implemented (MXFP8, 32-element blocks): constructed as in TE, refused when used."""

    format_name, predicate = "MXFP8 (32-element block scales)", "mxfp8"


class Float8BlockScaling(_UnavailableRecipe):
    """Not implemented (block-scaled FP8): constructed as in TE, refused when used."""

    format_name, predicate = "block-scaled FP8", "float8_block_scaling"


class NVFP4BlockScaling(_UnavailableRecipe):
    """Not implemented (NVFP4): constructed as in TE, refused when used."""

    format_name, predicate = "NVFP4", "nvfp4"


class CustomRecipe(_UnavailableRecipe):
    """Not implemented (custom quantizers): constructed as in TE, refused when used."""

    format_name, predicate = "a custom quantizer recipe", "custom"
