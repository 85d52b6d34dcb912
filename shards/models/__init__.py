"""The model library head and stages both use: resolving and reading models (folders, repos, the GGUF
default), slicing a range of layers, valid cuts, quantizing, profiling, the tokenizer's grammars.
"""
