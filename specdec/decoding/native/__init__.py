"""The native decode runner: Llama, Mistral, Qwen2 and Qwen3 decoding steps on specdec's own kernels, reading the
weights of the user's Hugging Face model (:class:`~specdec.decoding.native.model.NativeModelSlot`)."""

from specdec.decoding.native.config import NATIVE_MODEL_TYPES, NativeConfig, native_problem
from specdec.decoding.native.model import NativeModel, NativeModelSlot

__all__ = ["NATIVE_MODEL_TYPES", "NativeConfig", "NativeModel", "NativeModelSlot", "native_problem"]
