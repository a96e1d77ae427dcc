#!/usr/bin/env python
"""Convert the tiny model to GGUF; run from llama.cpp's source directory. The tiny model's
locally trained byte-level BPE uses GPT-2's pre-tokenization, which llama.cpp's converter
cannot recognise by its hash, so this names it and runs the converter."""
import runpy, sys
sys.path[:0] = ["gguf-py", "."]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
