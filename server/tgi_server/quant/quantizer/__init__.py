"""The in-repo quantizer behind `text-generation-server quantize`: GPTQ and
AWQ on self-generated (or given) calibration text, written in the standard
checkpoint layouts."""

from .quantize_model import load_float_model, quantize_model, save_float_model

__all__ = ["load_float_model", "quantize_model", "save_float_model"]
