"""specchat's engine: speculative decoding and early exit on Hugging Face models.

Headless: it never imports textual or rich, so it serves as a library and for
the `specchat generate` / `specchat bench` commands.
"""
