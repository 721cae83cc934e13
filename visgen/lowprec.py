"""A low-precision rollout copy of the denoiser (Sol-RL's explorer) through torchao, re-synced from the live weights.

``LowPrecisionExplorer(pipe, precision).sync()`` deep-copies ``pipe.transformer`` with its LoRA adapter merged into
the base weights (so the copy is the *current* policy), then quantizes its linear layers with torchao's
``quantize_``. The copy never receives gradients; the caller re-syncs it every iteration. ``explorer.adapter`` is
the pipeline's own visgen adapter with the copy in place of the transformer, so stage-1 sampling runs through the
one engine unchanged.

Precisions (``visgen.two_stage.precision``):

| name    | torchao config                                           | hardware                                   |
|---------|----------------------------------------------------------|--------------------------------------------|
| full    | none (a float32 copy; regeneration is then exact)         | any                                        |
| bf16    | none (bfloat16-rounded weights, float32 compute)          | any                                        |
| fp8     | ``Float8DynamicActivationFloat8WeightConfig(PerRow())``   | CUDA SM >= 8.9 (Ada, Hopper: H100/H200)    |
| mxfp8   | ``MXDynamicActivationMXWeightConfig`` (e4m3, blocks of 32)| native on Blackwell; emulated elsewhere    |
| mxfp4   | the same with ``float4_e2m1fn_x2``                        | native on Blackwell; emulated elsewhere    |
| nvfp4   | ``NVFP4DynamicActivationNVFP4WeightConfig`` on SM >= 10,  | weight-only emulation elsewhere            |
|         | ``NVFP4WeightOnlyConfig`` otherwise                       |                                            |

Where the hardware has the kernels the copy goes through torchao's ``quantize_`` with these configs. Elsewhere
(this CPU) it is *emulated*: every eligible linear layer's weights (and, for the dynamic-activation MX formats,
its inputs) are rounded through the format by torchao's own ``MXTensor.to_mx`` / ``NVFP4Tensor.to_nvfp4`` and
dequantised, and the matmul runs in float32 — the format's numerics without its kernels. The rank agreement and
reward per full-precision NFE they give are real; their wall time is not (it needs the hardware). Linear layers
whose dimensions are not multiples of the format's block (16 for NVFP4, 32 for MX) stay in full precision;
``quantized_fraction`` reports the share of linear weights that were quantised.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from shared_rl.config import ConfigError

# torch-free, so the config reads them without this module (visgen.lowprec.X as before)
from .part_settings import PRECISIONS, TwoStageSettings  # noqa: F401

__all__ = ["PRECISIONS", "check_precision", "merged_copy", "fake_quantize", "LowPrecisionExplorer", "TwoStageSettings"]

_BLOCK = {"fp8": 1, "mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def check_precision(precision: str, device: torch.device | str = "cpu") -> None:
    """ConfigError (one line, naming what would work) when ``precision`` cannot run on ``device``."""
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise ConfigError(f"visgen.two_stage.precision {precision!r} is unknown; choose one of {list(PRECISIONS)}")
    if precision == "fp8":
        cap = _capability(device)
        if cap is None or cap < (8, 9):
            raise ConfigError(f"visgen.two_stage.precision fp8 (W8A8, torchao Float8DynamicActivationFloat8WeightConfig) "
                              f"needs a CUDA GPU with compute capability >= 8.9 (Hopper such as the H200); this run is "
                              f"on {device}{'' if cap is None else f' (SM {cap[0]}.{cap[1]})'} — use mxfp8, mxfp4 or "
                              f"nvfp4 (emulated off Blackwell), bf16 or full")


def native(precision: str, device: torch.device) -> bool:
    """Whether ``device`` has kernels for ``precision`` (fp8: SM >= 8.9; MX and NVFP4: Blackwell, SM >= 10)."""
    cap = _capability(device)
    if precision == "fp8":
        return cap is not None and cap >= (8, 9)
    return precision in ("mxfp8", "mxfp4", "nvfp4") and cap is not None and cap >= (10, 0)


def _native_config(precision: str) -> Any:
    """torchao's config for the hardware path (``quantize_``)."""
    if precision == "fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if precision in ("mxfp8", "mxfp4"):
        from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig

        dtype = torch.float8_e4m3fn if precision == "mxfp8" else torch.float4_e2m1fn_x2
        return MXDynamicActivationMXWeightConfig(activation_dtype=dtype, weight_dtype=dtype)
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

    return NVFP4DynamicActivationNVFP4WeightConfig()


def fake_quantize(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` rounded through ``precision``'s format by torchao's own tensor classes (quantise -> dequantise) along
    the last dimension, in float32: the format's numerics without its kernels. MX: e4m3 / e2m1 elements with one
    e8m0 scale per 32; NVFP4: e2m1 elements, one e4m3 scale per 16 and a float32 per-tensor scale."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    if precision in ("mxfp8", "mxfp4"):
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        dtype = torch.float8_e4m3fn if precision == "mxfp8" else torch.float4_e2m1fn_x2
        out = MXTensor.to_mx(flat, dtype, _BLOCK[precision]).dequantize(torch.float32)
    elif precision == "nvfp4":
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

        out = NVFP4Tensor.to_nvfp4(flat, _BLOCK["nvfp4"], per_tensor_amax_to_scale(flat.abs().max().float())
                                   ).dequantize(torch.float32)
    else:
        raise ValueError(f"no fake quantisation for {precision!r}")
    return out.reshape(shape)


class _FakeQuantLinear(torch.nn.Module):
    """A linear layer with format-rounded weights and, for the dynamic-activation formats (MX), format-rounded
    inputs: the emulation of ``quantize_`` where the hardware has no kernels."""

    def __init__(self, linear: torch.nn.Linear, precision: str, activations: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight = torch.nn.Parameter(fake_quantize(linear.weight.float(), precision), requires_grad=False)
            self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.float().clone(),
                                                                            requires_grad=False)
        self.precision, self.activations = precision, activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations:
            x = fake_quantize(x.float(), self.precision).to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None
                                          else self.bias.to(x.dtype))


def merged_copy(transformer: torch.nn.Module) -> torch.nn.Module:
    """A detached deep copy of ``transformer`` with every peft LoRA layer merged into its base layer and unwrapped
    (the copy computes what the adapted model computes, with plain ``nn.Linear`` layers)."""
    out = copy.deepcopy(transformer)
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: nothing to merge
        LoraLayer = ()  # noqa: N806
    for name, module in list(out.named_modules()):
        if LoraLayer and isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = out.get_submodule(parent_name) if parent_name else out
            setattr(parent, child, module.get_base_layer())
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()


class _BF16Compute(torch.nn.Module):
    """Runs a bfloat16 model (torchao's MX/NVFP4 layouts need bf16 weights) behind the float32 interface the
    adapters use: floating inputs are cast to bf16, floating outputs back to float32."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def config(self):
        return self.model.config

    def forward(self, *args, **kwargs):
        def cast(x, dtype):
            return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

        out = self.model(*[cast(a, torch.bfloat16) for a in args],
                         **{k: cast(v, torch.bfloat16) for k, v in kwargs.items()})
        if isinstance(out, (tuple, list)):
            return type(out)(cast(o, torch.float32) for o in out)
        return cast(out, torch.float32)


class LowPrecisionExplorer:
    """The explorer copy of ``pipe``'s denoiser at ``precision`` (re-synced by :meth:`sync`)."""

    def __init__(self, pipe: Any, precision: str, device: torch.device | str | None = None) -> None:
        from .pipelines import as_adapter

        self.pipe, self.precision = pipe, precision
        self.source = as_adapter(pipe)
        self.device = torch.device(device) if device is not None else self.source.device
        check_precision(precision, self.device)
        self.native = native(precision, self.device)  # hardware kernels (quantize_) or torchao-rounding emulation
        self.model: torch.nn.Module | None = None
        self.quantized_fraction = 0.0
        base = type(self.source)
        self._adapter_cls = type(f"Explorer{base.__name__}", (base,),
                                 {"transformer": property(lambda a: a._explorer_model)})

    def sync(self) -> "LowPrecisionExplorer":
        """Rebuild the copy from the live weights (LoRA merged), then quantise it."""
        model = merged_copy(self.pipe.transformer)
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        total = sum(m.weight.numel() for _, m in linears) or 1
        self.quantized_fraction = 0.0
        if self.precision == "bf16":  # bfloat16 weights, float32 compute (the inputs of every adapter are float32)
            with torch.no_grad():
                for prm in model.parameters():
                    prm.copy_(prm.to(torch.bfloat16).float())
            self.quantized_fraction = 1.0
        elif self.precision != "full":
            block = _BLOCK[self.precision]
            fits = {n for n, m in linears if m.in_features % block == 0 and m.out_features % block == 0}
            self.quantized_fraction = sum(m.weight.numel() for n, m in linears if n in fits) / total
            if self.native:
                from torchao.quantization import quantize_

                if self.precision != "fp8":  # the MX / NVFP4 layouts take bfloat16 weights
                    model = model.to(torch.bfloat16)
                quantize_(model, _native_config(self.precision), filter_fn=lambda _m, fqn: fqn in fits)
                if self.precision != "fp8":
                    model = _BF16Compute(model)
            else:  # emulation: the format's rounding of weights (and MX activations), float32 matmuls
                for name in fits:
                    parent_name, _, child = name.rpartition(".")
                    parent = model.get_submodule(parent_name) if parent_name else model
                    setattr(parent, child, _FakeQuantLinear(getattr(parent, child), self.precision,
                                                            activations=self.precision in ("mxfp8", "mxfp4")))
        self.model = model
        return self

    @property
    def adapter(self):
        """The pipeline's visgen adapter running the explorer copy (``sync`` first)."""
        if self.model is None:
            raise RuntimeError("LowPrecisionExplorer.adapter before sync()")
        adapter = self._adapter_cls(self.pipe)
        adapter._explorer_model = self.model
        return adapter
