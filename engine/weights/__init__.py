"""Weights: model presets, fetching and converting files, loading a model with its
tokenizer, and the memory check before a load."""
