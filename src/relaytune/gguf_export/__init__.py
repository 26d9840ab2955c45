"""GGUF export for llama.cpp, Ollama and LM Studio, written with the `gguf` package.

Three entry points, each taking folders that relaytune already produces:
  - `write_gguf(model_dir, out_file, out_type)`: a merged Hugging Face folder
    (config.json, *.safetensors, tokenizer with its chat template) as one GGUF model;
  - `write_lora_gguf(adapter_dir, base_config, out_file)`: a PEFT LoRA adapter alone,
    as a llama.cpp LoRA GGUF to apply on top of the base model's GGUF;
  - `write_modelfile(gguf_file, chat_template, stop_tokens, out_dir)`: an Ollama
    Modelfile beside the GGUF, its TEMPLATE translated from the chat template.

Tensor names come from gguf's own name maps, quantization from gguf.quants, and the
file layout from gguf.GGUFWriter; nothing of llama.cpp's converter is copied. The
supported families are in `families.FAMILIES`; anything else is refused up front.
"""

from relaytune.gguf_export.families import FAMILIES, SUPPORTED
from relaytune.gguf_export.lora import write_lora_gguf
from relaytune.gguf_export.model import write_gguf
from relaytune.gguf_export.modelfile import write_modelfile
from relaytune.gguf_export.tensors import OUT_TYPES

__all__ = ["FAMILIES", "OUT_TYPES", "SUPPORTED", "write_gguf", "write_lora_gguf", "write_modelfile"]
