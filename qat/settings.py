"""How NNCF quantizes a model: the settings the qat and ptq stages share, passed whole to ``nncf_quant.quantize``,
``nncf_preflight.check_quantizable`` and the doctor check, never unpacked into their signatures.

    quantize(model, calib, NncfSettings(ignore=["head"], batch_size=16))
    quantize(model, calib, stage.config)  # a QatConfig or PtqConfig is one
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pruneflow.config import StrictModel

SMOOTH_QUANT = 0.95  # NNCF's own SmoothQuant alpha for transformers (see nncf_quant.transformer_arguments)


class NncfSettings(StrictModel):
    preset: Literal["performance", "mixed"] = Field(
        default="performance", description="`performance`: symmetric activations (what TensorRT wants); `mixed`: asymmetric activations."
    )
    ignore: list[str] = Field(default_factory=list, description="Module names, or NNCF node-name regexes, left in floating point.")
    activations: Literal["signed", "auto"] = Field(
        default="signed",
        description="`signed`: every activation quantizer is int8 with zero point 0, so the trained scales export exactly "
        "to TensorRT's convention and (as uint8: zero point 0 after a ReLU, 128 elsewhere) to CPU runtimes; `auto`: NNCF may use unsigned "
        "quantizers after ReLU (finer there, but no exact TensorRT form).",
    )
    ranges: Literal["auto", "minmax", "mean_minmax"] = Field(
        default="auto", description="How each activation quantizer's range is set from the calibration samples: `minmax` "
        "(the extremes seen: no calibration value is clipped), `mean_minmax` (NNCF's default: the mean over batches of each "
        "batch's extremes: a finer grid, rare tails clipped); `auto`: what the task asks for, `minmax` for regression (a "
        "clipped tail moves that sample's prediction: +28 % INT8 MSE on an MLP regressor with `mean_minmax`, +0.8 % with "
        "`minmax`), `mean_minmax` otherwise.")
    model_type: Literal["auto", "cnn", "transformer"] = Field(
        default="auto", description="NNCF's model type. `transformer`: Linear inputs and the attention score MatMul quantized; "
        "LayerNorm, Softmax, GELU, the context MatMul and embedding lookups kept float (the word-embedding table is stored "
        "int8 weight-only at export); `cnn`: NNCF's default; `auto`: `transformer` for text transformers (attention over token "
        "embeddings: BERT; and rankers: embedding tables, no convolution), `cnn` otherwise (a ViT too: its TensorRT INT8 "
        "form needs the cnn type's residual quantizers).")
    table_bits: Literal[8, 4] = Field(
        default=8, description="Embedding tables (every `nn.Embedding`/`EmbeddingBag` of 2+ columns and 1 KiB+) are stored "
        "weight-only with one scale per row: `8` (int8, -127..127: about 3.9x smaller than float32 for wide rows) or `4` "
        "(int4, -7..7, two values a byte: about 7x; coarser, so check the metric). The quantized model is measured "
        "with the rounded tables, and the CPU INT8 ONNX and OpenVINO IR store them so (standard operators only); the "
        "TensorRT form keeps them float.")
    smooth_quant: float | None = Field(
        default=SMOOTH_QUANT, ge=0, le=1, description="SmoothQuant's alpha for `model_type: transformer` (NNCF's default, 0.95): "
        "before ranges are set, per-channel scales move the activation outliers of each quantized Linear input (BERT's "
        "LayerNorm outputs reach 30 in a few channels) into its weights, so the int8 grid stays fine for the other "
        "channels. Adds one Mul per quantized Linear input to the INT8 ONNX (OpenVINO folds it); `null`: off.")
    calibration_size: int = Field(default=300, ge=1, description="Samples for range initialisation when no calibrate stage ran.")
    batch_size: int = Field(default=32, ge=1, description="Batch size for range initialisation.")
